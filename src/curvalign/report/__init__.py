"""curvalign.report"""
