"""kiln.frontend"""
