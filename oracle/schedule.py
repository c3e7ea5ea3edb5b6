"""Full depth by schedule, not by memory: where the tokens are known, a decoder stack can run layer by
layer (each layer over every call in order, with its own state), so that each weight is read once. For a
streamed checkpoint (its decoder layers read from the shards for each use: oracle.reference.streaming.LayerStream),
the models of a check that need a layer (HF at the candidate's precision with each attention, the
candidate) run it one after the other (`lockstep`), and the layer's tensors are read from disk once for
all of them (oracle.reference.streaming.RECENT keeps the layer read last).

A candidate that can run so (Candidate.ahead) computes its block rows and its e2e steps one layer at a
time, before the harness asks for them (`Ahead`); run_block and teacher_forced then answer from what was
kept, once each (a later call, e.g. the drill's, runs again)."""

from __future__ import annotations

# what a streamed candidate's report says of its schedule (provenance.backend.schedule)
LAYER_BY_LAYER = ("layer by layer: each decoder layer read once for its block rows and its stage of the e2e steps, "
                  "in turn with HF's noise measurement (oracle/schedule.py)")


def lockstep(passes: list) -> list:
    """Run generators that each yield once per decoder layer one layer at a time in turn; their return
    values, in order."""
    results, live = [None] * len(passes), list(enumerate(passes))
    while live:
        for i, g in list(live):
            try:
                next(g)
            except StopIteration as stop:
                results[i] = stop.value
                live.remove((i, g))
    return results


class Ahead:
    """A candidate's block rows and e2e steps computed ahead, one decoder layer at a time (`run`), answered
    once each: `block(key, calls, log)` -> its outputs (the router log given that run's entries) or None;
    `steps(tokens, prompt_len, calls, stepper)` -> teacher_forced's answer. A block that raised raises again
    when asked."""

    def __init__(self):
        self.blocks: dict = {}  # (layer, kind) -> (the calls it ran on, outputs or the exception, route entries)
        self.kept_steps = None  # ((tokens, prompt_len, calls), answer)

    def run(self, cand, ref, layers: int, stepper, log=None, on_block=None, on_layer=None):
        """The generator: for each decoder layer, its block rows (cand.run_block on the reference's calls),
        then its stage of the e2e steps (stepper.through(layer)); after the last, the final blocks and
        stepper.finish(). Yields after each layer. A stage that raises ends the steps (teacher_forced then
        runs them itself); the blocks go on. `log`: the candidate's oracle.verdict.replay.RouteLog, whose entries
        each block's run leaves are kept with it (block_routes reads them). `on_block(key, outputs, routes per
        call)`: the harness's work on a block while its layer is at hand (oracle/verdict/compare.py aligning);
        `on_layer(layer, the steps' routes so far: per call {layer: (indices, weights)})` after each stage of the
        steps (oracle/verdict/e2e.py ReplayAhead)."""
        keys = ref.block_keys()
        for layer in [*range(layers), None]:
            for key in keys:
                if key[0] == layer:
                    self._block(cand, key, ref.inputs[key], log, on_block)
            try:
                if stepper is not None and layer is not None:
                    stepper.through(layer)
                    if on_layer is not None:
                        on_layer(layer, stepper.routes)
                elif stepper is not None:
                    self.kept_steps = ((tuple(ref.tokens), ref.prompt_len, len(ref.logits)), stepper.finish())
            except Exception:  # noqa: BLE001 - the steps are run again when asked, and fail there with their error
                stepper = None
            if layer is not None:
                yield

    def _block(self, cand, key, calls, log, on_block):
        try:
            outs = cand.run_block(key[0], key[1], calls)
        except Exception as e:  # noqa: BLE001 - raised again when the harness asks for this block
            outs = e
        if log is not None:
            log.settle()
        self.blocks[key] = (calls, outs, list(log.entries) if log is not None else None)
        if on_block is not None and not isinstance(outs, Exception):
            on_block(key, outs, log.calls() if log is not None else None)

    def block(self, key, calls, log=None):
        kept = self.blocks.get(key)
        if kept is None or kept[0] is not calls:
            return None
        del self.blocks[key]
        if isinstance(kept[1], Exception):
            raise kept[1]
        if log is not None:  # block_routes reads what that run logged
            log.reset()
            log.entries.extend(kept[2])
        return kept[1]

    def steps(self, tokens, prompt_len: int, calls: int, stepper):
        """teacher_forced's answer: what `run` kept for these tokens (once), else `stepper()` (a new
        layer-by-layer run of them) run through every layer."""
        if self.kept_steps is not None and self.kept_steps[0] == (tuple(tokens), prompt_len, calls):
            answer, self.kept_steps = self.kept_steps[1], None
            return answer
        steps = stepper()
        for layer in range(steps.layers):
            steps.through(layer)
        return steps.finish()
