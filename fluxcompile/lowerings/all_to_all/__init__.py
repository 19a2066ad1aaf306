"""fluxcompile.all_to_all_matmul and fluxcompile.matmul_all_to_all: their choices. Both run their reference
implementation (``all_to_all_single`` + matmuls, registered by lowerings/choices.py) on every device; their
fused kernels register here, as the other ops' do in their folders."""

OPS = ("all_to_all_matmul", "matmul_all_to_all")
