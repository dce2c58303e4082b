"""kiln.backends"""
