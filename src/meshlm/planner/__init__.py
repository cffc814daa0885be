"""meshlm.planner"""
