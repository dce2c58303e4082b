"""kiln.passes.quantize"""
