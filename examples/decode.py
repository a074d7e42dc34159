"""ropepool in an inference engine: a Llama model's RoPE and KV-cache writes done by
ropepool.rope_pool_fused into a token pool, with prefill and greedy decode of a batch of
two sequences, checked against transformers' own generate() and forward on the same model.

    python examples/decode.py                  # CPU, both RoPE cases below
    python examples/decode.py --device cuda    # CUDA backend, decode step in a CUDA graph

The model is a small LlamaForCausalLM built by transformers from a config with random
weights (no download): once with plain RoPE (rope_theta), once with Llama 3.1's
`rope_scaling` (type llama3). The engine side:

- the KV cache is one token pool per layer, `[layers, rows, kv_heads, head_dim]`; a free
  list hands out rows (slots) one token at a time, so the two sequences' rows interleave,
  and a finished sequence's rows go back to it;
- every attention layer makes one rope_pool_fused call for the whole batch (prefill: all
  prompt tokens of both sequences packed; decode: one token per sequence): q and k
  rotated, the rotated k and v written to their slots;
- attention reads each sequence's rows from the pool by its slot table (torch SDPA);
- the decode step has fixed shapes (slot table padded to the longest sequence, masked by
  position), so on CUDA it is captured once in a CUDA graph and replayed, with token ids,
  positions, slots and the slot table updated in place before each replay.

Check: the generated tokens equal generate(do_sample=False)'s, and every logit (the 32
steps that chose the tokens, and every prompt position) is within TOLERANCE of
transformers' float32 values, relative to the largest logit of the step (the two sum in
different orders, and ropepool's angles are exact where transformers' are float32).
Exit status 0 when everything matches.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ropepool

TOLERANCE = 1e-4  # max |ours - transformers| / max |transformers logit| per step
NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 11)  # two sequences of different lengths

ROPE_CASES = {
    "rope_theta": dict(rope_theta=10000.0, rope_scaling=None),
    # Llama 3.1's scaling with the original context shrunk to this toy's length (64), so
    # that it changes most frequencies at the positions decoded here.
    "llama3": dict(rope_theta=500000.0, max_position_embeddings=512,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}),
}


def make_model(case: str, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        # Large enough weights that attention is far from uniform, so positions matter.
        initializer_range=0.1,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # decode all 32 tokens
        tie_word_embeddings=False, **ROPE_CASES[case])
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


class SlotAllocator:
    """A free list of pool rows."""

    def __init__(self, rows: int):
        self.free = list(range(rows - 1, -1, -1))

    def alloc(self) -> int:
        if not self.free:
            raise RuntimeError("KV pool full")
        return self.free.pop()

    def release(self, rows) -> None:
        self.free.extend(reversed(rows))


@dataclass
class Sequence:
    tokens: list[int]                               # prompt + generated
    slots: list[int] = field(default_factory=list)  # pool row of each position


class Engine:
    """The model's weights (the transformers modules) with ropepool attention on a pool."""

    def __init__(self, model: LlamaForCausalLM, pool_rows: int, device: str,
                 rope_override: dict | None = None):
        self.model = model.to(device)
        c = model.config
        self.device = device
        self.Hq, self.Hk, self.D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        # The schedule once, at model load, from the config as it is in config.json
        # (rope_override: a deliberately wrong one, to show the check can fail).
        # transformers 5.x keeps rope_theta inside config.rope_parameters, with the scaling
        # keys (ropepool accepts that dict: its rope_theta must equal rope_base); 4.x has
        # config.rope_theta and config.rope_scaling.
        params = getattr(c, "rope_parameters", None)
        rope = {"rope_base": params["rope_theta"] if params else c.rope_theta,
                "rope_scaling": params if params else c.rope_scaling,
                **(rope_override or {})}
        self.rope = dict(head_dim=self.D, num_qo_heads=self.Hq, num_kv_heads=self.Hk,
                         rope_base=rope["rope_base"],
                         schedule=ropepool.rope_schedule(head_dim=self.D, **rope))
        shape = (c.num_hidden_layers, pool_rows, self.Hk, self.D)
        self.k_cache = torch.zeros(shape, device=device)
        self.v_cache = torch.zeros(shape, device=device)
        self.allocator = SlotAllocator(pool_rows)

    def forward(self, ids, positions, slots, attend) -> torch.Tensor:
        """Logits [T, vocab] for tokens `ids` at `positions`, their k/v written to `slots`;
        `attend(layer, q_rot)` returns the attention output [T, Hq, D] from the pool."""
        m = self.model.model
        h = m.embed_tokens(ids)
        T = ids.shape[0]
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(T, self.Hq, self.D)
            k = a.k_proj(x).view(T, self.Hk, self.D)
            v = a.v_proj(x).view(T, self.Hk, self.D)
            q_rot, _, _, _ = ropepool.rope_pool_fused(
                q, k, v, positions, slots, self.k_cache[i], self.v_cache[i], **self.rope)
            h = h + a.o_proj(attend(i, q_rot).reshape(T, self.Hq * self.D))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(m.norm(h))

    def _attention(self, layer, q_rot, kv_rows, key_valid):
        """q_rot [B, n, Hq, D] against pool rows kv_rows [B, L]; key_valid [B, n, L]."""
        B, L = kv_rows.shape
        group = self.Hq // self.Hk  # query head j reads kv head j // group

        def gather(cache):  # [B, L, Hk, D] -> [B, Hq, L, D], no data-dependent shapes
            x = cache[layer][kv_rows].transpose(1, 2)[:, :, None]
            return x.expand(B, self.Hk, group, L, self.D).reshape(B, self.Hq, L, self.D)

        k, v = gather(self.k_cache), gather(self.v_cache)
        out = torch.nn.functional.scaled_dot_product_attention(
            q_rot.transpose(1, 2), k, v, attn_mask=key_valid[:, None])
        return out.transpose(1, 2)  # [B, n, Hq, D]

    def prefill(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """All prompt tokens of all sequences in one packed batch; logits per sequence."""
        ids, positions, slots = [], [], []
        for s in seqs:
            s.slots = [self.allocator.alloc() for _ in s.tokens]
            ids += s.tokens
            positions += range(len(s.tokens))
            slots += s.slots
        dev = self.device
        ids, positions, slots = (torch.tensor(x, device=dev) for x in (ids, positions, slots))
        lengths = [len(s.tokens) for s in seqs]

        def attend(layer, q_rot):
            outs = []
            for s, q in zip(seqs, q_rot.split(lengths)):
                n = len(s.slots)
                causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
                rows = torch.tensor(s.slots, device=dev)
                outs.append(self._attention(layer, q[None], rows[None], causal[None])[0])
            return torch.cat(outs)

        return list(self.forward(ids, positions, slots, attend).split(lengths))

    def decode_buffers(self, batch: int, max_len: int) -> dict:
        """The static inputs of a decode step (updated in place, replayed by a graph)."""
        z = dict(dtype=torch.int64, device=self.device)
        return dict(ids=torch.zeros(batch, **z), positions=torch.zeros(batch, **z),
                    slots=torch.zeros(batch, **z), kv_rows=torch.zeros(batch, max_len, **z))

    def decode_step(self, buf: dict) -> torch.Tensor:
        """One token per sequence, fixed shapes: logits [B, vocab]."""
        keys = torch.arange(buf["kv_rows"].shape[1], device=self.device)
        key_valid = keys[None, None, :] <= buf["positions"][:, None, None]  # [B, 1, L]

        def attend(layer, q_rot):
            return self._attention(layer, q_rot[:, None], buf["kv_rows"], key_valid)[:, 0]

        return self.forward(buf["ids"], buf["positions"], buf["slots"], attend)


@torch.inference_mode()
def generate(engine: Engine, prompts: list[list[int]], new_tokens: int, cuda_graph: bool):
    """Greedy decode; returns (generated tokens, per-step logits) per sequence, and the
    logits of every prompt position."""
    seqs = [Sequence(list(p)) for p in prompts]
    prompt_logits = engine.prefill(seqs)
    step_logits = [[lg[-1]] for lg in prompt_logits]
    for s, lg in zip(seqs, prompt_logits):
        s.tokens.append(int(lg[-1].argmax()))

    buf = engine.decode_buffers(len(seqs), max(len(p) for p in prompts) + new_tokens)
    step = None

    def load_step():  # the inputs of the next step, written into the static buffers
        ids, positions, slots = [], [], []
        for s in seqs:
            pos = len(s.tokens) - 1  # the newest token has no k/v in the pool yet
            s.slots.append(engine.allocator.alloc())
            ids.append(s.tokens[-1])
            positions.append(pos)
            slots.append(s.slots[pos])
        for name, x in (("ids", ids), ("positions", positions), ("slots", slots)):
            buf[name].copy_(torch.tensor(x))
        for b, s in enumerate(seqs):
            buf["kv_rows"][b, : len(s.slots)].copy_(torch.tensor(s.slots))

    for _ in range(new_tokens - 1):
        load_step()
        if cuda_graph:
            if step is None:
                step = capture(engine, buf)  # runs the step for this token too
            logits = step()
        else:
            logits = engine.decode_step(buf)
        for s, lg, kept in zip(seqs, logits, step_logits):
            s.tokens.append(int(lg.argmax()))
            kept.append(lg)
    if engine.device == "cuda":  # an out-of-range slot would be reported here (SPEC §3)
        ropepool.cuda_check_slot_errors()
    generated = [s.tokens[len(p):] for s, p in zip(seqs, prompts)]
    for s in seqs:  # the sequences are done: their rows go back to the pool
        engine.allocator.release(s.slots)
    return generated, [torch.stack(x).cpu() for x in step_logits], \
        [lg.cpu() for lg in prompt_logits]


def capture(engine: Engine, buf: dict):
    """Captures the decode step in a CUDA graph; returns a function that replays it.

    The warm-up runs the step with the inputs already in `buf` (writing the same pool rows
    the replay writes again, with the same values)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            engine.decode_step(buf)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = engine.decode_step(buf)

    def replay():
        graph.replay()
        return logits.clone()

    return replay


@torch.inference_mode()
def reference(model: LlamaForCausalLM, prompts, new_tokens):
    """transformers on its own: generate() per sequence, and a forward over the result."""
    tokens, step_logits, all_logits = [], [], []
    dev = model.device
    for p in prompts:
        ids = torch.tensor([p], device=dev)
        out = model.generate(ids, do_sample=False, max_new_tokens=new_tokens,
                             output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        gen = out.sequences[0, len(p):].tolist()
        tokens.append(gen)
        step_logits.append(torch.cat(out.logits).cpu())
        full = torch.tensor([p + gen[:-1]], device=dev)
        all_logits.append(model(full).logits[0].cpu())
    return tokens, step_logits, all_logits


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max over rows of max |ours - ref| / max |ref|."""
    return float(((ours - ref).abs().amax(-1) / ref.abs().amax(-1)).max())


def run_case(case: str, device: str = "cpu", cuda_graph: bool = False,
             rope_override: dict | None = None, verbose: bool = True) -> dict:
    model = make_model(case)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
               for n in PROMPT_LENGTHS]
    pool_rows = 4 * sum(n + NEW_TOKENS for n in PROMPT_LENGTHS)
    engine = Engine(model, pool_rows, device, rope_override)
    t0 = time.perf_counter()
    tokens, step_logits, prompt_logits = generate(engine, prompts, NEW_TOKENS, cuda_graph)
    elapsed = time.perf_counter() - t0
    ref_tokens, ref_step_logits, ref_all_logits = reference(engine.model, prompts, NEW_TOKENS)

    step_err = max(relative_error(a, b) for a, b in zip(step_logits, ref_step_logits))
    # Every prompt position, from the packed prefill, against the reference forward.
    prompt_err = max(relative_error(a, b[: len(a)])
                     for a, b in zip(prompt_logits, ref_all_logits))
    # The smallest top-1/top-2 gap transformers saw: how far from a tie greedy decoding was.
    top2 = torch.cat(ref_step_logits).topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    ok = tokens == ref_tokens and max(step_err, prompt_err) <= TOLERANCE
    if verbose:
        what = f"{device}" + (" + CUDA graph" if cuda_graph else "")
        print(f"[{case}] {what}: prompts of {PROMPT_LENGTHS} tokens, {NEW_TOKENS} new tokens "
              f"each in {elapsed * 1e3:.0f} ms")
        for b, (t, r) in enumerate(zip(tokens, ref_tokens)):
            print(f"  sequence {b}: {'identical' if t == r else 'DIFFERENT'} tokens "
                  f"{t[:8]}...")
        print(f"  logits vs transformers: decode steps {step_err:.2e}, prompt positions "
              f"{prompt_err:.2e} (tolerance {TOLERANCE:.0e}); smallest top-2 gap {margin:.3f}")
        print(f"  {'MATCH' if ok else 'MISMATCH'}")
    return dict(ok=ok, tokens=tokens, ref_tokens=ref_tokens, step_err=step_err,
                prompt_err=prompt_err, margin=margin)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--no-graph", action="store_true",
                        help="on CUDA, run the decode step eagerly instead of in a CUDA graph")
    parser.add_argument("--case", choices=sorted(ROPE_CASES), action="append",
                        help="RoPE case (default: all)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not (torch.cuda.is_available() and ropepool.cuda_backend):
        print("--device cuda needs a GPU and a ropepool built with the CUDA backend",
              file=sys.stderr)
        return 2
    results = [run_case(c, args.device, cuda_graph=args.device == "cuda" and not args.no_graph)
               for c in args.case or sorted(ROPE_CASES)]
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
