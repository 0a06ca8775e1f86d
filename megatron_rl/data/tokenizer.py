"""Tokenizers: Hugging Face ones from a directory, or a character-level one built locally."""

from pathlib import Path

SPECIALS = ("<pad>", "<bos>", "<eos>")


def build_char_tokenizer(alphabet: str, out_dir: str | Path):
    """A character-level tokenizer over `alphabet`, saved in HF format (tokenizer.json) in out_dir."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    hf.save_pretrained(str(out_dir))
    return hf


def build_bpe_tokenizer(texts, vocab_size: int, out_dir: str | Path):
    """A byte-level BPE tokenizer of at most `vocab_size` tokens trained on `texts` (the GPT-2 scheme, no
    prefix space; its base alphabet only the bytes the texts use), with the character tokenizer's
    special tokens, saved in HF format in out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    hf.save_pretrained(str(out_dir))
    return hf


def load_tokenizer(path: str | Path, pad_token: str = ""):
    """An HF tokenizer; pad_token: '' keeps its own (eos when it has none), 'eos' pads with eos,
    else the named token."""
    from transformers import AutoTokenizer

    from megatron_rl.config import ConfigError

    if not str(path):  # Path("") is the current directory
        raise ConfigError("data.train_path needs the model's tokenizer: set model.hf_path (a Hugging Face checkpoint, "
                          "whose tokenizer is used) or data.tokenizer.")
    if not Path(path).is_dir():
        raise ConfigError(f"tokenizer directory {str(path)!r} does not exist; set data.tokenizer to an HF tokenizer directory.")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{str(path)!r} is not a tokenizer transformers can load ({first.rstrip(': ')}); point "
                          "data.tokenizer (or model.hf_path) at a directory with tokenizer.json or "
                          "tokenizer_config.json.") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"the tokenizer in {str(path)!r} has no end-of-sequence token (eos_token): samples could "
                          "not end; set eos_token in its tokenizer_config.json.")
    if pad_token and pad_token != "eos" and pad_token not in tok.get_vocab():
        raise ConfigError(f"data.pad_token={pad_token!r} is not a token of {str(path)!r}; use 'eos' or one of its tokens.")
    if pad_token == "eos" or tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    elif pad_token:
        tok.pad_token = pad_token
    return tok


def tokenizer_difference(a, b) -> str | None:
    """How tokenizer b turns text into ids differently from a (its token-to-id map, its length, its
    special tokens), in words, or None when they agree."""
    if len(a) != len(b):
        return f"{len(b)} tokens against {len(a)}"
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        token = next(t for t in sorted(set(va) | set(vb)) if va.get(t) != vb.get(t))
        return f"token {token!r} has id {vb.get(token)} against {va.get(token)}"
    if a.all_special_ids != b.all_special_ids:
        return f"special tokens {b.all_special_tokens} against {a.all_special_tokens}"
    return None


def decode_texts(tokenizer, ids: list[list[int]]) -> list[str]:
    """Each list of token ids as text, special tokens left out."""
    return [tokenizer.decode(x, skip_special_tokens=True) for x in ids]


def prompt_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """[bos] + the prompt's tokens (no second bos when a chat template already rendered one)."""
    bos = tokenizer.bos_token_id
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [p if bos is None or p[:1] == [bos] else [bos] + p for p in ids]
