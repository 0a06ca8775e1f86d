"""Built-in reward functions: (prompt, completion, metadata) -> float."""


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
