"""AsyncScheduler: the Scheduler for overlap scheduling (`async_scheduling`).

The engine schedules step N+1 before step N's sampled tokens reach the host and
applies N's results one step late.  A token sampled by an in-flight step is a
placeholder (`Request.num_output_placeholders`): scheduling counts it (the runner
reads the real id on the device), stop checks wait for it.  So a request that stops
at step N may already be in step N+1; that extra token is dropped, and the blocks of
a request that finishes while a step using them is in flight are freed only once
that step's results are in.

Steps are numbered (`SchedulerOutput.step_id`) and a request remembers the first and
the latest step that scheduled it, so this class keeps no list of in-flight steps
(the engine's is the only one): results must come back in step order, a step is in
flight while its id is above the last applied one, and a token from a step older
than a request belongs to an earlier request that used the same id.
"""

from __future__ import annotations

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.core.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 max_loras: int = 0, long_rope_original: int | None = None) -> None:
        super().__init__(scheduler_config, kv_cache_manager, max_loras=max_loras, long_rope_original=long_rope_original)
        self._num_scheduled_steps = 0  # step ids handed out (the next one is this number)
        self._num_applied_steps = 0  # steps whose results were applied, in order
        # Finished requests whose blocks an in-flight step still uses, by id.
        self._deferred_free: dict[str, Request] = {}

    @property
    def num_inflight_steps(self) -> int:
        return self._num_scheduled_steps - self._num_applied_steps

    @property
    def num_deferred_frees(self) -> int:
        """Finished requests whose blocks wait for an in-flight step."""
        return len(self._deferred_free)

    def is_in_flight(self, request: Request) -> bool:
        """Whether a step that scheduled `request` has not had its results applied."""
        return request.last_scheduled_step >= self._num_applied_steps

    # ------------------------------------------------------------------ hooks
    def _admit(self, request: Request) -> None:
        old = self._deferred_free.pop(request.request_id, None)
        if old is not None:
            # Block tables are keyed by id.  Freeing early is safe: the device runs steps
            # in launch order, so the in-flight step is done with these blocks before
            # any later step can write them.
            self.kv_cache_manager.free(old)

    def _after_schedule(self, out: SchedulerOutput) -> None:
        """Every request whose known and pending tokens are all computed after this step
        samples one more, which stays a placeholder until the step's results are applied."""
        step = out.step_id = self._num_scheduled_steps
        self._num_scheduled_steps += 1
        requests = self.requests
        for req_id in out.num_scheduled_tokens:
            request = requests[req_id]
            if request.first_scheduled_step < 0:
                request.first_scheduled_step = step
            request.last_scheduled_step = step
            if request.num_computed_tokens == len(request.all_token_ids) + request.num_output_placeholders:
                request.num_output_placeholders += 1

    def _begin_update(self, scheduler_output: SchedulerOutput) -> None:
        if scheduler_output.step_id != self._num_applied_steps:
            raise RuntimeError("async scheduling: results must be processed once each, in the order "
                               "the steps were scheduled")

    def _takes_sample(self, request: Request, scheduler_output: SchedulerOutput) -> bool:
        if request.first_scheduled_step > scheduler_output.step_id or not request.num_output_placeholders:
            return False  # the id's earlier owner was aborted; this one was not in that step
        request.num_output_placeholders -= 1
        return True  # a preempted request keeps it too: the step computed it validly

    def _end_update(self) -> None:
        self._num_applied_steps += 1
        if self._deferred_free:
            for req_id, request in list(self._deferred_free.items()):
                if not self.is_in_flight(request):
                    del self._deferred_free[req_id]
                    self.kv_cache_manager.free(request)

    def _free_blocks(self, request: Request) -> None:
        if self.is_in_flight(request):
            self._deferred_free[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
