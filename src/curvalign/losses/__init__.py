"""curvalign.losses"""
