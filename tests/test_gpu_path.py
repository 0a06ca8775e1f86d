"""What the CPU can prove about the GPU path: attention masks in the query's dtype (a float32 mask
with bf16 queries sends CUDA's attention to another kernel than training's), no host reads inside a
forward (platform/syncs.py: on a GPU each is a wait for the device, and a step with one cannot be
captured in a CUDA graph), a budget of two per optimizer step, and the training attention of a
packed microbatch in one call per layer on CUDA."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.platform import device, syncs
from tests.helpers import PROMPTS, bf16_trainee, loss_fn, microbatch_forward, random_char_engine


def test_the_harness_counts_reads_and_not_device_work():
    x = torch.arange(6.0)
    with syncs.counting(cuda=False) as reads:
        x.sum().item()
        x[x > 2]  # a boolean mask: the output's size depends on the data
        x.tolist()
        torch.repeat_interleave(torch.tensor([1, 2]))  # its output size is read from the device
        x.cpu()
        bool(x.any())
    with syncs.counting(cuda=False) as none:
        y = (x * 2).sum(0)
        x[torch.tensor([0, 2])]
        torch.repeat_interleave(torch.arange(2), torch.tensor([1, 2]), output_size=3)
        x.to(device())  # the compute device, not the host
        torch.searchsorted(x, y[None])
    assert reads.count == 6, reads.report()
    assert none.count == 0, none.report()


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_a_training_microbatch_reads_nothing_from_the_device(one_process, packed):
    trainee, micro = bf16_trainee(packed)
    forward = microbatch_forward(trainee, micro[0])
    with syncs.counting() as reads:
        forward().float().logsumexp(-1).sum().backward()  # gradients into the DDP buffers too
    assert reads.count == 0, reads.report()


def test_an_optimizer_step_reads_the_device_twice_and_norms_once(one_process):
    """The step's report and the gradient norm's finite check: one read each. The norm (one
    torch._foreach_norm) is megatron's get_grad_norm to the bit, and clipping scales the gradients to it."""
    from megatron_rl.training import step

    trainee, micro = bf16_trainee(packed=False)
    optimizer = trainee.optimizer
    adam_steps = [s["step"] for sub in optimizer.chained_optimizers for s in sub.optimizer.state.values()]
    with syncs.counting(host=adam_steps) as reads:  # torch Adam keeps its step counts on the host
        reports = step.forward_backward(trainee, micro, loss_fn)
        report = step.reduce_reports(reports)
    optimizer.prepare_grads()
    expected = optimizer.get_grad_norm()
    with syncs.counting(host=adam_steps) as more:
        applied, norm = step.optimizer_step(trainee)
    assert applied and reads.count + more.count <= 2, reads.report() + "\n" + more.report()
    assert report["tokens"] == float(sum(m["loss_mask"].sum() for m in micro))
    assert norm == expected
    assert norm > 1.0  # so clipping to optimizer.clip_grad = 1 applied
    assert step.global_norm(step.squared_grad_norms(optimizer).tolist()) == pytest.approx(1.0, rel=1e-5)


def test_replayed_kept_sets_read_nothing_from_the_device(one_process):
    """top-p / top-k in training: bf16 logits, the sampler's thresholds replayed in the log-probs, their
    backward, and the kept sets' sizes read the device no more than the log-probs without them (megatron's
    vocab_parallel_cross_entropy reads it twice, its boolean index_put_)."""
    from megatron_rl.training.logprobs import kept_size, token_logprobs

    logits = torch.randn(2, 6, 16, device=device(), dtype=torch.bfloat16, requires_grad=True)
    labels, threshold = torch.randint(0, 16, (2, 6), device=device()), torch.zeros(2, 6, device=device())
    with syncs.counting() as plain:
        token_logprobs(logits, labels).sum().backward()
    with syncs.counting() as replayed:
        token_logprobs(logits, labels, threshold).sum().backward()
        kept_size(logits.detach(), threshold)
    assert replayed.count == plain.count <= 2, replayed.report()


def test_rollout_forwards_read_nothing_from_the_device(one_process, tmp_path):
    """Prefill and decode steps, bf16: no read inside the model's forward. megatron's engine reads
    the device between forwards (its bookkeeping: BENCHMARKS.md lists it)."""
    _, chunks, engine = random_char_engine(tmp_path, max_new_tokens=8, precision="bf16")
    with syncs.counting(inside=chunks) as inside:
        engine.generate(PROMPTS, n=2, seed=0)
    with syncs.counting(cuda=False) as everywhere:
        engine.generate(PROMPTS, n=2, seed=0)
    assert inside.count == 0, inside.report()
    assert everywhere.count > 0  # the harness sees megatron's reads outside the forward


def test_every_attention_mask_is_bool_or_in_the_query_dtype(one_process, tmp_path, monkeypatch):
    """bf16 training (rows and packed), prefill and decode: every scaled_dot_product_attention call
    gets no mask, a boolean one, or one in its query's dtype."""
    sdpa, calls = F.scaled_dot_product_attention, []

    def checked(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.dtype, None if attn_mask is None else attn_mask.dtype))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", checked)
    _, _, engine = random_char_engine(tmp_path, max_new_tokens=8, precision="bf16")
    engine.generate(PROMPTS, seed=0)
    for packed in (False, True):
        trainee, micro = bf16_trainee(packed)
        with torch.no_grad():
            microbatch_forward(trainee, micro[0])()
    wrong = {(q, m) for q, m in calls if m is not None and m != torch.bool and m != q}
    assert {q for q, _ in calls} == {torch.bfloat16} and not wrong, f"masks of another dtype: {wrong}"


def test_packed_attention_in_one_call_as_on_cuda(monkeypatch):
    """The CUDA plan (every sample padded to the longest, one call per layer) gives the CPU plan's
    outputs, each sample seeing only its own tokens."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.platform.attention import CoreAttention, packed_plan

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16)
    attention = CoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal).eval()
    g = torch.Generator().manual_seed(0)
    lengths = [5, 17, 1, 32, 9]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(int(cu[-1]), h, 16, generator=g) for h in (4, 2, 2))
    sdpa, calls = F.scaled_dot_product_attention, []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    outputs = {}
    for one_call in (False, True):
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
        params.attention_plan = packed_plan(cu, torch.device("cpu"), one_call=one_call)
        calls.clear()
        with torch.no_grad():
            outputs[one_call] = attention(q, k, v, None, packed_seq_params=params)
        assert len(calls) == (1 if one_call else len(params.attention_plan.groups))
    torch.testing.assert_close(outputs[True], outputs[False], rtol=1e-5, atol=1e-6)
    first = attention(q[:5, None], k[:5, None], v[:5, None], None)[:, 0]  # the first sample alone, unpacked
    torch.testing.assert_close(outputs[True][:5], first, rtol=1e-5, atol=1e-6)


def test_training_stays_out_of_the_decode_cuda_graphs():
    """With rollout.cuda_graphs the layers carry megatron's graph manager, which would also capture the
    training forward (any call without an inference context); platform/fixes.py keeps training eager."""
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_layer import TransformerLayer

    layer = SimpleNamespace(cudagraph_manager=object(), training=True)
    decide = TransformerLayer._should_call_local_cudagraph
    assert decide.__wrapped__(layer, attention_mask=None, inference_context=None), "megatron graphs training now?"
    assert not decide(layer, attention_mask=None, inference_context=None)


def test_gpu_check_dry_run(tmp_path):
    """bench/gpu_check.sh --dry-run: every phase of the GPU script at toy size on the CPU, each passing
    (the batch-invariant run is refused here: it needs CUDA), with the bf16 mismatch in its summary."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT, launch_env

    env = {**launch_env(), "OUT": str(tmp_path / "out"), "LOGS": str(tmp_path / "logs"), "PYTHON": sys.executable}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    outcomes = dict(line.split()[:2] for line in summary.splitlines() if " rc=" in line)
    expected = {"sft_bf16", "grpo_bf16", "grpo_bf16_invariant", "probe", "rollout_b64", "grpo_vs_trl", "pytest"}
    assert set(outcomes) == expected, summary + proc.stderr[-2000:]
    assert outcomes.pop("grpo_bf16_invariant") == "rc=2", summary
    assert set(outcomes.values()) == {"rc=0"}, summary
    mismatch = next(line for line in summary.splitlines() if line.startswith("bf16 mismatch"))
    assert float(mismatch.split()[3]) <= 1e-5, summary  # max, bf16 on the CPU
    assert (tmp_path / "out" / "results.tar.gz").exists()


def test_weights_unchanged_needs_no_cpu_module_on_cuda(monkeypatch):
    """On a GPU the platform never imports platform/cpu.py, so the stretch without weight changes that every
    rollout and training step opens must not reach for it there (it raised NameError on CUDA)."""
    import contextlib

    from megatron_rl import platform

    monkeypatch.setattr(platform, "has_cuda", lambda: True)
    monkeypatch.delattr(platform, "_cpu")
    with platform.weights_unchanged() as inside:
        assert inside is None
    assert isinstance(platform.weights_unchanged(), contextlib.nullcontext)
