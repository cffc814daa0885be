"""meshlm.infer"""
