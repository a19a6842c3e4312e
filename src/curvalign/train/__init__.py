"""curvalign.train"""
