"""ReMax: the reward of a greedy completion is the baseline of the sampled ones.

Per prompt, ``n_samples`` sampled completions and one greedy completion are generated
concurrently; each sampled row gets ``reward(sample) - reward(greedy)``. Only sampled
rows are returned (the greedy one is a baseline, not trained on), with the same layout
as ``RLVRWorkflow`` and per-sequence ``rewards`` [n].
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, cast

from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient
from tandemrl.data.batch import concat_padded_tensors
from tandemrl.utils import stats_tracker
from tandemrl.workflows.rlvr import RLVRWorkflow, check_response, completion_row


class ReMaxRLVRWorkflow(RLVRWorkflow):
    """RLVR with a greedy-decoding baseline subtracted from each sample's reward."""

    async def arun_episode(self, client: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        prompt_ids = self.prompt_ids(data)
        rid = uuid.uuid4().hex
        sample_cfg = self.gconfig.new(n_samples=1)
        greedy_cfg = self.gconfig.new(n_samples=1, greedy=True)
        n = self.gconfig.n_samples
        resps = await asyncio.gather(
            *[client.agenerate(self.request(prompt_ids, sample_cfg, rid, self.sample_seed(data, i))) for i in range(n)],
            client.agenerate(self.request(prompt_ids, greedy_cfg, rid)),
        )
        samples, greedy = list(resps[:n]), resps[n]
        check_response(greedy)
        prompt = self.tokenizer.decode(prompt_ids)
        scores = await asyncio.gather(*[self.score(prompt, prompt_ids, r.output_tokens, data) for r in resps])
        if self.drop_group(scores):
            return None
        scored = cast(list[float], scores)  # none failed (drop_group)
        sample_rewards, greedy_reward = scored[:n], scored[n]
        rows = []
        for resp, reward in zip(samples, sample_rewards, strict=True):
            rows.append(completion_row(prompt_ids, resp, reward - greedy_reward))
            self.record(resp, reward)
        stats_tracker.get(self.stat_scope).scalar(greedy_reward=greedy_reward)
        self.dump(prompt, samples, sample_rewards)
        return concat_padded_tensors(rows)
