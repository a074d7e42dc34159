"""bench/torch_overhead.py on the CPU: every row makes the call its name says (an fp8 q_rot
where it says fp8 q, no k_rot where it says so, the same rotation as the plain call where the
schedule is the same), and the benchmark prints one line per row. (Its timing is a benchmark,
not a test: scripts/gpu_check.sh runs it on CUDA.)"""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import torch_overhead  # noqa: E402


def test_every_row_makes_the_call_its_name_says():
    results = {}
    for name, family, call in torch_overhead.rows("cpu", 256):
        out = call()
        if name.startswith("binding"):
            assert out is None, name
            continue
        if family == "mla":
            q_rot, k_rot, latent = out
            assert q_rot.shape == (1, 16, 64) and k_rot.shape == (1, 64), name
            results[name] = q_rot
            continue
        q_rot, k_rot, k_pool, v_pool = out
        assert q_rot.dtype == (torch.float8_e4m3fn if "fp8 q" in name else torch.bfloat16), name
        assert (k_rot is None) == ("no k_rot" in name), name
        assert k_pool.dtype == (torch.float8_e4m3fn if family == "fp8" else torch.bfloat16), name
        results[name] = q_rot
    plain = results["plain [P, Hk, D]"]
    assert torch.equal(results["NHD page 16"], plain)
    assert torch.equal(results["llama3 rope_scaling dict"], results["llama3 schedule="])
    assert not torch.equal(results["llama3 schedule="], plain)  # position 70000: scaled
    assert not torch.equal(results["QK norm (weights in bf16)"], plain)
    assert not torch.equal(results["Qwen2-VL mRoPE rope_scaling dict"], plain)
    assert torch.equal(results["MLA yarn rope_scaling dict"], results["MLA schedule="])


def test_prints_one_line_per_row(capsys):
    torch_overhead.main(["--calls", "2", "--rounds", "3", "--pool-rows", "256"])
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| ") and "µs" not in x]
    names = [name for name, _, _ in torch_overhead.rows("cpu", 256)]
    assert [x.split(" | ")[0][2:] for x in lines] == names
    for x in lines:
        float(x.split(" | ")[1].split()[0])  # a number of µs
