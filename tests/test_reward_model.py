"""Reward models and Hugging Face: scores read where transformers reads them (pad == eos, left and
right padding), *ForSequenceClassification import and export, and a causal LM as a reward model's start."""

import json

import pytest
import torch

from megatron_rl.config import Config
from tests.hf_models import save_tiny_model

pytestmark = pytest.mark.fp32("rollout/training, layout and resume equalities at fp32 precision")

SCORE_TOL = 1e-4  # fp32, max abs difference


def load_reward_model(path, **model_overrides):
    from megatron_rl.hf import import_hf, model_config_from_hf
    from megatron_rl.training.setup import build_model

    cfg = Config(model=model_config_from_hf(path))
    for k, v in model_overrides.items():
        setattr(cfg.model, k, v)
    chunks, _ = build_model(cfg, wrap_ddp=False)
    import_hf(chunks, cfg.model, path)
    chunks[0].eval()
    return chunks, cfg.model


def sequences(tok, n=5, seed=0) -> list[list[int]]:
    """[bos] ... [eos] of varying lengths, the content avoiding special tokens."""
    g = torch.Generator().manual_seed(seed)
    return [[tok.bos_token_id, *torch.randint(3, 40, (int(k),), generator=g).tolist(), tok.eos_token_id]
            for k in torch.randint(3, 12, (n,), generator=g)]


def padded(seqs, pad, left=False) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, sl], mask[i, sl] = torch.tensor(s), 1
    return ids, mask


def hf_scores(path, ids, mask) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, 0]


@pytest.mark.parametrize("family, pad_is_eos", [("llama", False), ("qwen3", True), ("qwen2", True),
                                                ("nemotron", False)])
def test_scores_match_transformers_with_either_padding(family, pad_is_eos, one_process, tmp_path):
    """Our score model, imported from a *ForSequenceClassification, scores as transformers does: at
    the rightmost non-pad token (the token before eos when pad == eos), right- or left-padded."""
    from transformers import AutoTokenizer

    from megatron_rl.training.heads import score_sequences
    from model_providers.heads import score_positions

    path = save_tiny_model(family, tmp_path / family, reward_model=True, pad_is_eos=pad_is_eos)
    tok = AutoTokenizer.from_pretrained(str(path))
    chunks, model = load_reward_model(path)
    assert model.head == "score"
    seqs = sequences(tok)
    right, mask = padded(seqs, tok.pad_token_id)
    ours = score_sequences(chunks, right, tok.pad_token_id, micro_batch_size=2)
    expected_pos = [len(s) - (2 if pad_is_eos else 1) for s in seqs]
    assert score_positions(right, tok.pad_token_id).tolist() == expected_pos
    for left in (False, True):
        ids, m = padded(seqs, tok.pad_token_id, left)
        reference = hf_scores(path, ids, m)
        assert reference.std() > 0.1  # scores far apart: a wrong position would show
        assert (ours - reference).abs().max() <= SCORE_TOL, (left, ours, reference)


def test_reward_model_export_import_round_trip(one_process, tmp_path):
    """HF -> ours -> HF is bit-exact with a ForSequenceClassification config; a score model trained
    from scratch exports to one that transformers loads and that scores as ours does."""
    from transformers import AutoTokenizer

    from megatron_rl.hf import export_hf, write_assets
    from megatron_rl.training.heads import score_sequences
    from megatron_rl.training.setup import build_model
    from tests.test_convert import assert_bit_exact

    path = save_tiny_model("qwen3", tmp_path / "rm", reward_model=True, seed=3)
    chunks, model = load_reward_model(path)
    write_assets(path, tmp_path / "assets")
    export_hf(chunks, model, tmp_path / "back", assets=tmp_path / "assets")
    assert_bit_exact(path, tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForSequenceClassification"] and len(config["id2label"]) == 1

    tok = AutoTokenizer.from_pretrained(str(path))
    cfg = Config()
    cfg.model.family, cfg.model.head, cfg.model.vocab_size, cfg.model.init_method_std = "llama", "score", len(tok), 0.3
    fresh, _ = build_model(cfg, wrap_ddp=False)
    fresh[0].eval()
    (tmp_path / "tok").mkdir()
    tok.save_pretrained(str(tmp_path / "tok"))
    export_hf(fresh, cfg.model, tmp_path / "scratch", assets=tmp_path / "tok")
    config = json.loads((tmp_path / "scratch" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["pad_token_id"] == tok.pad_token_id
    ids, mask = padded(sequences(tok, seed=1), tok.pad_token_id)
    ours = score_sequences(fresh, ids, tok.pad_token_id, micro_batch_size=8)
    assert (ours - hf_scores(tmp_path / "scratch", ids, mask)).abs().max() <= SCORE_TOL


def test_causal_lm_starts_a_reward_model_and_not_the_reverse(one_process, tmp_path, capsys):
    """A reward model started from a causal LM keeps its backbone, drops lm_head (a note says so) and
    starts with a fresh head; a language model is never started from a reward model."""
    from megatron_rl.config import ConfigError
    from megatron_rl.hf import resolve_model
    from model_providers.heads import HEAD_SEED

    lm = save_tiny_model("llama", tmp_path / "lm", seed=1)
    chunks, _ = load_reward_model(lm, head="score")
    out = capsys.readouterr().out
    assert "its output layer is dropped and the score head starts fresh" in out
    assert "skipped 1 HF tensors (lm_head.weight, ...)" in out
    head = chunks[0].score_head.weight
    expected = torch.randn(1, head.shape[1], generator=torch.Generator().manual_seed(HEAD_SEED)) * 0.02
    assert torch.equal(head.detach(), expected)
    rm = save_tiny_model("llama", tmp_path / "rm", reward_model=True)
    with pytest.raises(ConfigError, match="holds a reward model .* trains a language model"):
        cfg = Config()
        cfg.model.hf_path = str(rm)
        resolve_model(cfg.model)


def test_reward_model_scores_the_policy_ids_or_re_tokenizes(tmp_path):
    """GRPO's reward model scores [bos] prompt completion [eos] as it was trained: the policy's ids
    when the tokenizers are the same (a generated eos is not doubled), else the text re-tokenized."""
    from megatron_rl.environments.reward_model import RewardModel, same_tokenizer
    from tests.hf_models import make_tokenizer

    tok = make_tokenizer(tmp_path / "a")
    other = make_tokenizer(tmp_path / "b")
    other.pad_token = other.eos_token
    assert same_tokenizer(tok, make_tokenizer(tmp_path / "c")) and not same_tokenizer(tok, other)
    rm = RewardModel.__new__(RewardModel)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    prompt, done, cut = [bos, *tok("1+2=")["input_ids"]], [*tok("3")["input_ids"], eos], tok("33")["input_ids"]
    rm.tokenizer, rm.same = tok, True
    assert rm.sequences(["1+2="] * 2, ["3", "33"], ([prompt, prompt], [done, cut])) == [prompt + done, prompt + cut + [eos]]
    rm.tokenizer, rm.same = other, False
    assert rm.sequences(["1+2="], ["3"], ([prompt], [done])) == [prompt + done]  # same text, re-tokenized
