"""DCP on an S3 store (moto server on 127.0.0.1): single-process save/load, and an FSDP2 checkpoint saved on
2 ranks loaded resharded on 3, every rank reaching the server through the standard AWS environment only."""

from __future__ import annotations

import pytest
import torch

import deltackpt
from deltackpt.store import Store
from dist import run_ranks
from test_dcp_reshard import CHUNK, _load_at_n, _save_at_2

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def test_single_process_save_and_load_on_s3(s3_server, s3_url):
    opts = s3_server.storage_options
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(300_000, generator=g), "b": torch.randn(100, generator=g), "step": 1}
    deltackpt.save(sd, s3_url, "one", storage_options=opts)
    first = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in sd.items()}
    sd["w"][:1000] += 1
    sd["step"] = 2
    deltackpt.save(sd, s3_url, "two", storage_options=opts)
    out = {"w": torch.zeros(300_000), "b": torch.zeros(100), "step": 0}
    assert deltackpt.load(out, s3_url, storage_options=opts) == "two"
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"]) and out["step"] == 2
    deltackpt.load(out, s3_url, "one", storage_options=opts)
    assert torch.equal(out["w"], first["w"]) and out["step"] == 1
    store = Store.open(s3_url, storage_options=opts)
    assert [i.name for i in store.list_checkpoints()] == ["one", "two"]
    assert store.cache_dir.is_absolute() and "b-" not in str(store.cache_dir.parts[0])


@pytest.fixture(scope="module")
def saved_at_2_on_s3(s3_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("s3reshard")
    url, ref_file = f"s3://{s3_server.new_bucket()}/run", str(tmp / "ref.pt")
    Store.init(url, storage_options=s3_server.storage_options, chunk_size_bytes=CHUNK)
    assert run_ranks(_save_at_2, 2, url, ref_file, timeout=150, env=s3_server.env) == [True, True]
    return url, ref_file


@pytest.mark.distributed
def test_fsdp2_saved_on_2_ranks_loads_resharded_on_3_from_s3(s3_server, saved_at_2_on_s3):
    url, ref_file = saved_at_2_on_s3
    assert run_ranks(_load_at_n, 3, url, ref_file, True, timeout=180, env=s3_server.env) == [True] * 3
    store = Store.open(url, storage_options=s3_server.storage_options)
    stats = store.read_manifest("resaved-at-3").stats
    assert stats.stored_bytes < 0.05 * stats.logical_bytes, stats
