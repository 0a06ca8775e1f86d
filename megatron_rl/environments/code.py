"""A code tool: the model writes a Python program in <code>...</code> (generation stops at </code>),
the program runs in the sandbox (megatron_rl/environments/sandbox.py, settings in the sandbox
section), and what it printed comes back as <result>...</result>, or <result>error: ...</result> when
it failed, timed out or wrote too much. A turn without a tool call is the answer: the episode ends,
scored by exact match of that turn's text against metadata['answer']."""

import re

from . import Environment, Turn, last_of
from .sandbox import Sandbox

CALL = re.compile(r"<code>(.*?)</code>\s*$", re.S)


class CodeEnvironment(Environment):
    stop = ["</code>"]
    role = "tool"
    max_result_chars = 256  # of the program's output, in the observation

    def __init__(self, cfg=None):
        from megatron_rl.config import Config

        self.sandbox = Sandbox((cfg or Config()).sandbox)

    def step_one(self, conversation, metadata):
        text = last_of(conversation, "assistant")
        call = CALL.search(text)
        if call is None:  # an answer
            answer = text.strip()
            return Turn(reward=float(answer == str(metadata["answer"]).strip()), done=True, answer=answer or None)
        outcome = self.sandbox.run(call.group(1))
        result = outcome.stdout.strip() if outcome.status == "ok" else f"error: {outcome.describe()}"
        return Turn(reward=0.0, done=False, observation=f"<result>{result[: self.max_result_chars]}</result>",
                    stop=self.stop)


class CodeOff(CodeEnvironment):
    """The code tool switched off: every call gets an empty result (to measure what the tool is worth)."""

    def __init__(self, cfg=None):
        pass

    def step_one(self, conversation, metadata):
        if CALL.search(last_of(conversation, "assistant")):
            return Turn(reward=0.0, done=False, observation="<result></result>", stop=self.stop)
        return super().step_one(conversation, metadata)  # an answer: scored as with the tool
