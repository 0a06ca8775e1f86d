"""The sliding puzzle as a multi-turn environment (rewards.fn=sliding_puzzle); its rules and data are in
data/puzzle.py."""

from megatron_rl.data.puzzle import ACTION, MOVES, move, solved

from . import Environment, Turn, last_of


class SlidingPuzzle(Environment):
    stop = ["</action>"]

    def __init__(self, cfg=None):
        pass

    def step_one(self, conversation, metadata):
        board = metadata["board"]
        found = ACTION.search(last_of(conversation, "assistant"))
        direction = found.group(1).strip().lower() if found else None
        after = move(board, direction) if direction in MOVES else None
        if after is None:
            why = ("write one move as <action>up</action> (or down, left, right)" if direction not in MOVES else
                   f"the empty cell cannot move {direction} from here")
            return Turn(reward=0.0, done=False, observation=f"{board} invalid: {why}", stop=self.stop)
        size = len(board.split(" "))
        if after == solved(size):
            return Turn(reward=1.0, done=True, answer=after, metadata={**metadata, "board": after})
        return Turn(reward=0.0, done=False, observation=after, stop=self.stop,
                    metadata={**metadata, "board": after})
