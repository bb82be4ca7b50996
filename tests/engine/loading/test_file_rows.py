"""Rows of a stored 2-D tensor read by pread (the embedding table's lookups) equal the same rows
indexed through the file's mapping, for every dtype a table is stored in; bad ids and a file
truncated under the reader get typed errors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from engine.errors import ModelFormatError
from engine.layers.embedding import StoredEmbedding
from engine.loading.safetensors import SafetensorsFile


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_by_pread_equal_the_mapped_table(tmp_path, dtype):
    g = torch.Generator().manual_seed(11)
    table = torch.randn(300, 48, generator=g).to(dtype)
    save_file({"a.bias": torch.randn(7, generator=g), "model.embed_tokens.weight": table}, tmp_path / "t.safetensors")
    with SafetensorsFile(tmp_path / "t.safetensors") as f:
        mapped = f.get("model.embed_tokens.weight")
        rows = f.rows("model.embed_tokens.weight")
        assert f.rows("a.bias") is None  # 1-D: no rows
        ids = torch.randint(0, 300, (3, 9), generator=g)
        got = rows(ids)
        assert got.shape == (3, 9, 48) and got.dtype == dtype
        assert torch.equal(got, mapped[ids]) and torch.equal(got, table[ids])
        emb = StoredEmbedding(mapped, torch.float32, rows=rows)
        assert emb.rows is rows and torch.equal(emb(ids), table[ids].float())
        # a reader of another shape is not this table's: the mapping is indexed instead
        assert StoredEmbedding(mapped[:200], torch.float32, rows=rows).rows is None
        with pytest.raises(IndexError, match="300 rows"):
            rows(torch.tensor([0, 300]))
        with pytest.raises(IndexError):
            rows(torch.tensor([-1]))
        rows.close()
        with pytest.raises(ValueError, match="after close"):
            rows(torch.tensor([1]))


def test_a_truncated_file_is_a_typed_error(tmp_path):
    table = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    path = tmp_path / "t.safetensors"
    save_file({"w": table}, path)
    with SafetensorsFile(path) as f:
        rows = f.rows("w")
        assert torch.equal(rows(torch.tensor([63])), table[63:64])
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size - 16 * 4 * 8)  # the last 8 rows gone
        assert torch.equal(rows(torch.tensor([0, 55])), table[[0, 55]])
        with pytest.raises(ModelFormatError, match="row 60"):
            rows(torch.tensor([60]))
        rows.close()
