"""curvalign.index"""
