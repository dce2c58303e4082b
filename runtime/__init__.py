"""kiln.runtime"""
