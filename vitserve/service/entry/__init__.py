"""entry"""
