"""The sliding puzzle's rules and data (data.task=sliding_puzzle; environments/puzzle.py plays it).

A sliding puzzle: an n x n board of tiles 1 .. n*n-1 and one empty cell (0), written row by row with a
space between rows ('123 456 780' is the solved 3 x 3 board). The prompt is the board; each turn the
model moves the empty cell with <action>up</action> (or down, left, right; generation stops at
</action>). A valid move is answered with the new board; an invalid one (no action, an unknown
direction, or off the board) with the same board and a hint, the episode going on. Solving it ends
the episode with reward 1; the rollout's turn limit ends it with 0.

Boards are made by random legal moves from the solved one, so every board is solvable."""

import random
import re

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}
ACTION = re.compile(r"<action>(.*?)</action>\s*$", re.S)


def solved(size: int) -> str:
    cells = [str(i) for i in range(1, size * size)] + ["0"]
    return " ".join("".join(cells[r * size:(r + 1) * size]) for r in range(size))


def move(board: str, direction: str) -> str | None:
    """The board after moving the empty cell, or None when the move leaves the board."""
    rows = [list(r) for r in board.split(" ")]
    size = len(rows)
    r, c = next((i, row.index("0")) for i, row in enumerate(rows) if "0" in row)
    dr, dc = MOVES[direction]
    if not (0 <= r + dr < size and 0 <= c + dc < size):
        return None
    rows[r][c], rows[r + dr][c + dc] = rows[r + dr][c + dc], "0"
    return " ".join("".join(row) for row in rows)


def scramble(size: int, depth: int, rng: random.Random) -> str:
    """A board `depth` random legal moves from the solved one (never undoing the last move), not solved."""
    while True:
        board, last = solved(size), None
        for _ in range(depth):
            options = [d for d in MOVES if d != OPPOSITE.get(last) and move(board, d) is not None]
            last = rng.choice(options)
            board = move(board, last)
        if board != solved(size):
            return board


def solution(board: str) -> list[str]:
    """The shortest sequence of moves that solves `board` (breadth-first; the first of equal ones in
    MOVES order)."""
    from collections import deque

    goal, previous = solved(len(board.split(" "))), {board: None}
    queue = deque([board])
    while queue:
        b = queue.popleft()
        if b == goal:
            path = []
            while previous[b] is not None:
                b, m = previous[b]
                path.append(m)
            return path[::-1]
        for m in MOVES:
            after = move(b, m)
            if after is not None and after not in previous:
                previous[after] = (b, m)
                queue.append(after)
    raise ValueError(f"board {board!r} cannot be solved")


def demonstration(board: str, rng: random.Random | None = None, detour: float = 0.0) -> list[dict]:
    """A solution as an episode's turns: each move, then the board it leads to (as the environment
    answers it), but for the last, which solves it. Shortest, or with `detour`, each move a random legal
    one with that chance (the solution goes on from where it leads; at most one detour)."""
    goal, turns, detours = solved(len(board.split(" "))), [], 0
    while board != goal:
        m = solution(board)[0]
        if rng is not None and detours < 1 and rng.random() < detour:
            m, detours = rng.choice([d for d in MOVES if move(board, d) is not None]), detours + 1
        board = move(board, m)
        turns += [{"role": "assistant", "content": f"<action>{m}</action>"}, {"role": "environment", "content": board}]
    return turns[:-1]


ALPHABET = "0123456789 <>/:," + "abcdefghijklmnopqrstuvwxyz"  # boards, actions and hints


def write_splits(out_dir, num_train: int, num_val: int, size: int, depth: int, seed: int, detour: float = 0.0):
    """train.jsonl and val.jsonl: boards `depth` random moves from solved, as {'prompt': the board,
    'board', 'turns': a solution, in training with random detours (`detour`), in validation shortest}.
    A shallow scramble of a small board reaches few boards (3 x 3: 39 at depth 6, 342 at depth 10), so
    the splits are drawn from all of them alike and may share boards; returns the paths."""
    import json
    from pathlib import Path

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = out_dir / "train.jsonl", out_dir / "val.jsonl"
    for path, n, noise in zip(paths, (num_train, num_val), (detour, 0.0)):
        boards = [scramble(size, depth, rng) for _ in range(n)]
        path.write_text("".join(json.dumps({"prompt": b, "board": b, "turns": demonstration(b, rng, noise)}) + "\n"
                                for b in boards))
    return paths
