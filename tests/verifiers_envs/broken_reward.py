"""A verifiers 0.4 environment whose reward raises (tests/e2e/test_verifiers_env.py): its episodes must drop their
group with the cause, not score 0."""

import verifiers.v1 as vf

__all__ = ["BrokenRewardTaskset"]


class BrokenTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=1.0)
    async def divided(self, trace: vf.Trace) -> float:
        return 1 / 0


class BrokenRewardTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        for i in range(4):
            yield BrokenTask(vf.TaskData(prompt=f"Say {i}."), self.config.task)
