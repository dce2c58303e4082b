"""kiln.passes.cleanup"""
