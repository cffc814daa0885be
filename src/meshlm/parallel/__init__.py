"""meshlm.parallel"""
