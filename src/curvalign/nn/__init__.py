"""curvalign.nn"""
