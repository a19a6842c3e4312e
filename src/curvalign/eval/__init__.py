"""curvalign.eval"""
