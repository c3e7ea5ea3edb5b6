"""`executorch-mlx`: the production model through ExecuTorch's MLX delegate, its importable setup from
the pip wheel, and an interpreter of its lowered graph on `mlx` where no runtime has the delegate."""
