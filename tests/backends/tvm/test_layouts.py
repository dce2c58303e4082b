"""Weight layouts made a slice of rows at a time equal the layouts made whole, for every kind."""

import pytest
import torch

from kiln.backends.tvm import layouts
from kiln.backends.tvm.layouts import apply_layout, stored_name, stored_weights

TRANSFORMS = [
    ("tiled:16", torch.float32),
    ("int4_tiled:gguf:32", torch.uint8),
    ("dot_tiled:8:none:48:8:128", torch.int8),
    ("dot_tiled:8:none:48:6:32", torch.int8),
    ("dot_high:8:none:48:6:32", torch.int8),
    ("dot_tiled:4:pairs:16:4:0", torch.uint8),
]


def _weight(dtype: torch.dtype, rows: int, columns: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows)
    if dtype == torch.float32:
        return torch.randn(rows, columns, generator=generator)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (rows, columns // 2), generator=generator, dtype=torch.uint8)
    return torch.randint(-32, 32, (rows, columns), generator=generator, dtype=torch.int8)


@pytest.mark.parametrize(("transform", "dtype"), TRANSFORMS)
def test_a_layout_made_in_slices_equals_it_made_whole(
    monkeypatch, transform: str, dtype: torch.dtype
) -> None:
    tensor = _weight(dtype, 96 * 7, 64)
    whole = apply_layout(transform, tensor)
    monkeypatch.setattr(layouts, "LAYOUT_ROWS", 100)  # slices of 112, 128 or 144 rows: whole tiles
    assert torch.equal(apply_layout(transform, tensor), whole)


def test_factored_scales_in_slices(monkeypatch) -> None:
    factors = torch.randint(-60, 60, (64 * 5, 16)).to(torch.float32)
    base = 2.0 ** -torch.randint(4, 12, (64 * 5, 2)).to(torch.float32)  # a float per run of 8 groups
    scales = factors * base.repeat_interleave(8, dim=1)
    whole = [apply_layout(f"factored_{kind}:32:8", scales) for kind in ("sub", "super")]
    monkeypatch.setattr(layouts, "LAYOUT_ROWS", 64)
    assert all(
        torch.equal(apply_layout(f"factored_{k}:32:8", scales), w)
        for k, w in zip(("sub", "super"), whole, strict=True)
    )


def test_each_stored_weight_once_under_its_layouts_name() -> None:
    params = [
        {"source": "w", "transform": "tiled:16", "shape": [2, 8, 16], "dtype": "float32"},
        {"source": "w", "transform": "tiled:16", "shape": [2, 8, 16], "dtype": "float32"},
        {"source": "b", "transform": "none", "shape": [32], "dtype": "float32"},
    ]
    stored = stored_weights(params)
    assert [(w.name, w.source, w.shape) for w in stored] == [
        ("w@tiled:16", "w", (2, 8, 16)),
        ("b", "b", (32,)),
    ]
    assert stored_name("b", "none") == "b"
    weight = torch.randn(32, 8)
    assert torch.equal(stored[0].lay_out(weight), apply_layout("tiled:16", weight))


def test_kquant_scales_factor_into_the_files_float16_d() -> None:
    """d * sc with d a float16 whose product with the sc's common factor is not one (d = 1 + 2^-10, sc
    all multiples of 3): D is d itself; with a negative d and sc from -128 to 126, or all zero, D * c
    still gives every scale back."""
    from kiln.backends.tvm.layouts import factored

    d = torch.tensor([[1 + 2**-10], [-0.0123], [0.0]], dtype=torch.float16).to(torch.float64)
    sc = torch.tensor([[3, 6, 9, 63, 3, 3, 3, 3], [-128, 2, 4, 8, 16, 32, 64, 126], [1] * 8])
    scales = (d * sc).to(torch.float32)
    base, factors = factored(scales, 8)
    assert base.dtype == torch.float16 and factors.dtype == torch.int8
    assert torch.equal(base.to(torch.float32) * factors.to(torch.float32), scales)
    assert base[0, 0].item() == d[0, 0].item()  # 3 * d is no float16: D is d
