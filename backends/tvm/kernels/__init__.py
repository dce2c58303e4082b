from kiln.backends.tvm.kernels import script_macros

script_macros.install()
