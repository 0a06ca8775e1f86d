"""Cross-tokenizer alignment: two tokenizations of one text grouped into chunks that end where both
have a token boundary (approximate likelihood matching, ALM; Minixhofer et al. 2025).

Both tokenizers tokenize the same text with offset mappings (character spans). A token boundary is
the end of a token whose successor starts at or after that end: byte-level tokens that split one
multi-byte character all carry that character's span, so no boundary falls inside a character. The
shared boundaries cut the text into chunks; each token belongs to the chunk its span ends in. A
chunk's likelihood under a model is the product of its tokens' probabilities, so both models assign a
likelihood to the same piece of text, whatever their vocabularies.
"""


def boundaries(offsets: list[tuple[int, int]]) -> set[int]:
    """Character positions at which a tokenization has a token boundary (token ends whose next token
    does not start before them); tokens without a span (specials: (0, 0) after the first) are skipped."""
    spans = [(s, e) for i, (s, e) in enumerate(offsets) if e > s]
    return {e for i, (_, e) in enumerate(spans) if i + 1 == len(spans) or spans[i + 1][0] >= e}


def chunk_of_tokens(offsets: list[tuple[int, int]], cuts: list[int]) -> list[int]:
    """The chunk (0-based) of each token, chunk j ending at cuts[j]: the first cut at or after the
    token's end; -1 for a token without a span or beyond the last cut."""
    import bisect

    chunks = [bisect.bisect_left(cuts, e) if e > s else -1 for s, e in offsets]
    return [j if j < len(cuts) else -1 for j in chunks]


def align(a_offsets: list[tuple[int, int]], b_offsets: list[tuple[int, int]]) -> tuple[list[int], list[int], int]:
    """(chunk of each token of a, chunk of each token of b, number of chunks) for two tokenizations of
    one text. Chunks end at the boundaries both share, the last at the end of the text both cover."""
    cuts = sorted(boundaries(a_offsets) & boundaries(b_offsets))
    return chunk_of_tokens(a_offsets, cuts), chunk_of_tokens(b_offsets, cuts), len(cuts)


def tokenize_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character spans of `text` without special tokens (a fast tokenizer's offset mapping)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def cross_batches(prompt_texts: list[str], responses: list[str], ended: list[bool], student_prompts: list[list[int]],
                  student_tok, teacher_tok, seq_length: int, multiple: int = 16) -> tuple[dict, dict]:
    """The student's and the teacher's training tensors of the same samples, each in its own tokens:
    prompt (the student's ids as sampled; the teacher's [bos] + its tokens of the prompt text), then the
    response text as each tokenizer tokenizes it, then each one's eos where the sample ended.

    Each gets "chunk" (N, W) at the positions whose label is a response token: the chunk of that token
    (the eos is a chunk of its own), -1 elsewhere. The student's side also gets "chunk_valid"
    (N, seq_length + 1) marking each sample's chunks; that axis is one longer than the token axis so that
    context parallelism never cuts it. The teacher's width W is its longest sequence rounded up to
    `multiple`."""
    import torch

    from .rl import pack
    from .tokenizer import prompt_ids

    s_resp, t_resp, s_chunks, t_chunks, count = [], [], [], [], []
    for text, end in zip(responses, ended):
        s_ids, s_off = tokenize_with_offsets(student_tok, text)
        t_ids, t_off = tokenize_with_offsets(teacher_tok, text)
        s_of, t_of, n = align(s_off, t_off)
        if end:
            s_ids, t_ids = s_ids + [student_tok.eos_token_id], t_ids + [teacher_tok.eos_token_id]
            s_of, t_of, n = s_of + [n], t_of + [n], n + 1
        s_resp.append(s_ids), t_resp.append(t_ids), count.append(n)
        s_chunks.append([c + 1 for c in s_of]), t_chunks.append([c + 1 for c in t_of])  # 0: no chunk
    t_prompts = prompt_ids(teacher_tok, prompt_texts)
    longest = max(len(p) + len(c) - 1 for p, c in zip(t_prompts, t_resp))
    student = pack(student_prompts, s_resp, seq_length, student_tok.pad_token_id, chunk=s_chunks)
    teacher = pack(t_prompts, t_resp, -(-longest // multiple) * multiple, teacher_tok.pad_token_id, chunk=t_chunks)
    for side in (student, teacher):
        side["chunk"] = side["chunk"].long() - 1
    student["chunk_valid"] = (torch.arange(seq_length + 1)[None, :] < torch.tensor(count)[:, None]).float()
    return student, teacher


def chunk_sums(values, chunk, width: int):
    """Per-token values (N, W) summed per chunk into (N, width); tokens with chunk -1 are left out."""
    import torch

    hit = chunk >= 0
    out = torch.zeros(values.shape[0], width, dtype=values.dtype, device=values.device)
    return out.scatter_add(1, chunk.clamp(min=0), values * hit)
