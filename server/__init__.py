"""kiln.server"""
