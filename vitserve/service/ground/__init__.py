"""ground"""
