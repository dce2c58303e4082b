"""kiln.passes.fusion"""
