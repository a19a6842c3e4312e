"""curvalign.data"""
