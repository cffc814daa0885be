"""meshlm.train"""
