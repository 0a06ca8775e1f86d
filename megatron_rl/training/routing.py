"""MoE rollout router replay (R3): the experts chosen during the rollout are used in training.

Each MoE router of megatron-core picks its top-k experts through `router.router_replay` when one
is set (megatron's RouterReplay hook). `RoutingTape` installs its own object on every router of a
model (megatron's keeps all instances of the process in one global list, which a second model, the
reference policy, would mix up):

- record: during the rollout (prefill and every decode step) it keeps the experts of each token
  the engine fed, keyed by (request id, position) from the dynamic context. Tokens whose experts
  an earlier pass recorded (a multi-turn episode's earlier turns, which each turn prefills again)
  are routed to those experts again: every token keeps the routing of the pass that generated it,
  and the KV cache later turns read was computed with it;
- replay: for each training-side forward (old policy, reference, training), `queue` loads each
  microbatch's routes cut as the router sees its tokens (sequence-major; this rank's context- and
  sequence-parallel share); forwards take them in microbatch order, and a forward that autograd
  re-runs inside the backward (activation recompute) takes them again in the same order;
- observe (replay off): it compares the training forward's own choices with the rollout's, for
  `moe/routing_mismatch_frac`.

Routes are -1 where the rollout fed no token (the last generated token, padding); replay uses
experts 0..k-1 there, whose outputs reach no loss term (causal attention, masked labels).
"""

from collections import deque
from contextlib import contextmanager

import torch


class LayerTape:
    """One router's queues (duck-types megatron's RouterReplay.get_replay_topk)."""

    def __init__(self, tape: "RoutingTape", layer: int):
        self.tape, self.layer = tape, layer
        self.forward: deque = deque()  # (experts, valid, fed) per microbatch forward, in schedule order
        self.backward: deque = deque()  # the same, for forwards re-run inside the backward

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        tape = self.tape

        def own_choice():
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)

        if tape.mode == "record":
            probs, chosen = own_choice()
            return tape.record(self.layer, scores, probs, chosen)
        if tape.mode not in ("replay", "observe"):
            return own_choice()
        in_backward = torch._C._current_graph_task_id() != -1  # a forward re-run by activation recompute
        queue = self.backward if in_backward else self.forward
        if not queue:
            raise RuntimeError(f"router replay: no routes queued for this forward of MoE layer {self.layer}.")
        experts, valid, fed = queue.popleft()
        if not in_backward:
            self.backward.append((experts, valid, fed))
        experts = experts.to(scores.device)
        if tape.mode == "replay":
            if in_backward:
                tape.count(recomputed=int((valid & fed).sum()))
            else:
                tape.count(replayed=int((valid & fed).sum()), routed=int(fed.sum()))
            return scores.gather(1, experts), experts
        probs, chosen = own_choice()
        if not in_backward:
            valid = valid & fed
            same = (chosen.sort(dim=-1).values == experts.sort(dim=-1).values).all(dim=-1)
            tape.count(mismatched=int((~same & valid.to(same.device)).sum()), compared=int(valid.sum()))
        return probs, chosen


class RoutingTape:
    """Router record/replay for one model (its chunks on this rank)."""

    def __init__(self, model_chunks: list, topk: int, sequence_parallel: bool):
        from megatron.core.transformer.moe.router import TopKRouter

        self.topk, self.sequence_parallel = topk, sequence_parallel
        self.mode = None
        self.layers: list[LayerTape] = []
        self.layer_numbers: list[int] = []  # each router's layer in the whole model (1-based, megatron's)
        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.router_replay = LayerTape(self, len(self.layers))
                    self.layers.append(module.router_replay)
                    self.layer_numbers.append(module.layer_number)
        self.context = None
        self.known = None  # (request id -> row, experts (rows, tokens, layers, topk)) routed again
        self.records: list[list] = []
        self.counts = dict.fromkeys(("replayed", "routed", "recomputed", "mismatched", "compared"), 0)

    def count(self, **amounts):
        for k, v in amounts.items():
            self.counts[k] += v

    def take_counts(self) -> dict:
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return counts

    # --- rollout -------------------------------------------------------------------------------
    def start_recording(self, context, known: dict | None = None):
        """known: per request id, the experts (tokens, layers, topk) of its first tokens from an
        earlier pass, which route those tokens again."""
        self.mode, self.context = "record", context
        self.records = [[] for _ in self.layers]
        self.known = None
        if known:
            longest = max(len(r) for r in known.values())
            table = torch.full((len(known), max(longest, 1), len(self.layers), self.topk), -1, dtype=torch.long)
            row_of = torch.full((max(known) + 2,), -1, dtype=torch.long)  # request id -> row; the last: unknown ids
            for row, (request, experts) in enumerate(known.items()):
                table[row, :len(experts)] = experts
                row_of[request] = row
            self.known = (row_of, table)

    def record(self, layer: int, scores: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor):
        """The experts of one engine step's tokens, with whose tokens they are; those known from an
        earlier pass replace the router's choice. Returns the (probs, experts) the layer uses. With
        sequence parallelism this TP rank routed a slice of the step's (padded) tokens."""
        from megatron.core import parallel_state as ps

        c = self.context
        rows = experts.shape[0]
        start = ps.get_tensor_model_parallel_rank() * rows if rows < c.padded_active_token_count else 0
        span = torch.arange(start, start + rows, device=experts.device)
        valid = span < c.active_token_count
        span = span[valid]
        requests = c.request_ids[c.token_to_request_idx[span]].cpu()
        positions = c.token_to_pos_ids[span].cpu()
        if self.known is not None:
            row_of, table = self.known
            row = row_of[requests.clamp(max=len(row_of) - 1)]
            again = table[row.clamp(min=0), positions.clamp(max=table.shape[1] - 1), layer]  # (tokens, topk)
            again_ok = (row >= 0) & (positions < table.shape[1]) & (again >= 0).all(dim=-1)
            if again_ok.any():
                where = valid.nonzero()[:, 0][again_ok.to(valid.device)]
                experts, probs = experts.clone(), probs.clone()
                experts[where] = again[again_ok].to(experts.device, experts.dtype)
                probs[where] = scores[where].gather(1, experts[where])
        self.records[layer].append((requests, positions, experts[valid].cpu()))
        return probs, experts

    def collect(self, request_ids: list[int], fed: list[int]) -> list[torch.Tensor]:
        """Per request, its recorded experts (fed tokens, layers, topk), -1 where none; merged over
        the tensor-parallel group (with sequence parallelism each rank recorded a slice)."""
        from megatron.core import parallel_state as ps

        self.mode, self.context, self.known = None, None, None
        index = {r: i for i, r in enumerate(request_ids)}
        out = torch.full((len(request_ids), max(fed, default=0), len(self.layers), self.topk), -1, dtype=torch.long)
        for layer, records in enumerate(self.records):
            for requests, positions, experts in records:
                rows = torch.tensor([index.get(int(r), -1) for r in requests], dtype=torch.long)
                keep = (rows >= 0) & (positions < out.shape[1])
                out[rows[keep], positions[keep], layer] = experts[keep].long()
        self.records = []
        if ps.get_tensor_model_parallel_world_size() > 1:  # recorded entries are >= 0 > -1
            torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX,
                                         group=ps.get_tensor_model_parallel_group())
        return [out[i, :n] for i, n in enumerate(fed)]

    # --- training ------------------------------------------------------------------------------
    def queue(self, micro: list[dict], replay: bool):
        """Load each microbatch's routes (mb["routes"]: (B, S, layers, topk), -1 where unknown) for
        the forwards that follow: replayed, or compared with the forward's own choices. mb["fed"]
        (B, S) marks the positions the rollout fed a token at (for the replay share)."""
        from megatron.core import parallel_state as ps

        from megatron_rl.data.packing import packed_row
        from megatron_rl.training.step import cp_share

        self.mode = "replay" if replay else "observe"
        self.clear_queues()
        if not self.layers:  # a pipeline stage without MoE layers (a hybrid's, say): nothing to route
            return
        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        default = torch.arange(self.topk)
        for mb in micro:
            if "pack_cu" in mb:  # the forward sees the packed row (data/packing.py)
                routes, fed = packed_row(mb["routes"], mb, -1), packed_row(mb["fed"], mb, False)
            else:
                share = cp_share({k: mb[k] for k in ("tokens", "routes", "fed")})
                routes, fed = share["routes"], share["fed"]
            if self.sequence_parallel and tp > 1:
                s = routes.shape[1] // tp
                routes, fed = routes[:, tp_rank * s:(tp_rank + 1) * s], fed[:, tp_rank * s:(tp_rank + 1) * s]
            tokens_first = routes.transpose(0, 1).reshape(-1, len(self.layers), self.topk)  # [seq, batch] order
            fed = fed.transpose(0, 1).reshape(-1)
            valid = (tokens_first >= 0).all(dim=-1)  # (tokens, layers)
            experts = torch.where(valid[..., None], tokens_first, default)
            for layer in self.layers:
                layer.forward.append((experts[:, layer.layer].contiguous(), valid[:, layer.layer], fed))

    def finish(self):
        self.mode = None
        self.clear_queues()

    def clear_queues(self):
        for layer in self.layers:
            layer.forward.clear()
            layer.backward.clear()


@contextmanager
def routes_queued(tape, micro: list[dict], replay: bool):
    """The forwards (and recomputed backwards) inside take each microbatch's routes from `tape`:
    replayed, or compared with their own choices. Without a tape (dense model): nothing."""
    if tape is None:
        yield
        return
    tape.queue(micro, replay)
    try:
        yield
    finally:
        tape.finish()


def pack_routes(routes: list[torch.Tensor], seq_length: int) -> dict[str, torch.Tensor]:
    """Per-sample routes (fed tokens, layers, topk) -> "routes" (N, seq_length, layers, topk), -1
    padded: position j holds the experts of the token the training forward sees at j (rl.pack's
    tokens); and "fed" (N, seq_length), the positions the rollout fed a token at."""
    layers, topk = routes[0].shape[1:]
    out = torch.full((len(routes), seq_length, layers, topk), -1, dtype=torch.long)
    fed = torch.zeros(len(routes), seq_length, dtype=torch.bool)
    for i, r in enumerate(routes):
        n = min(len(r), seq_length)
        out[i, :n] = r[:n]
        fed[i, :n] = True
    return {"routes": out, "fed": fed}
