"""Built-in reward functions: (prompt, completion, metadata) -> float, or named components."""


def exact_match(prompt: str, completion: str, metadata: dict) -> float:
    """1.0 if the completion (surrounding white space ignored) equals metadata['answer']."""
    return float(completion.strip() == str(metadata["answer"]).strip())


def math_answer(prompt: str, completion: str, metadata: dict) -> float:
    """1.0 if the completion's final answer (\\boxed{...} or plain) is mathematically equal to
    metadata['answer'], as math-verify judges (LaTeX, fractions, numeric equivalence)."""
    from math_verify import parse, verify

    gold = parse(str(metadata["answer"]))
    answer = parse(completion)
    return float(bool(gold) and bool(answer) and verify(gold, answer))


def exact_match_parts(prompt: str, completion: str, metadata: dict) -> dict:
    """Two named components: 'correct' (exact match) and 'digits' (the completion is a number at
    all), for multi-reward methods such as GDPO."""
    text = completion.strip()
    return {"correct": exact_match(prompt, completion, metadata), "digits": float(text.isdigit())}


BUILTIN = {"exact_match": exact_match, "exact_match_parts": exact_match_parts, "math": math_answer}
