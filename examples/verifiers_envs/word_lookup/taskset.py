"""The word_lookup taskset: one task per word of ``tools.NUMBERS``."""

import verifiers.v1 as vf

from word_lookup.tools import NUMBERS, LookupToolset


class LookupTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class LookupData(vf.TaskData):
    number: str
    """What the tool returns for the task's word."""


class LookupTask(vf.Task[LookupData, vf.State, LookupTaskConfig]):
    @classmethod
    def toolsets(cls, config: LookupTaskConfig) -> list[vf.Toolset]:
        return [LookupToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def found(self, trace: vf.Trace) -> float:
        return float(self.data.number in (trace.last_reply or ""))


class WordLookupConfig(vf.TasksetConfig):
    task: LookupTaskConfig = LookupTaskConfig()


class WordLookupTaskset(vf.Taskset[LookupTask, WordLookupConfig]):
    def load(self) -> list[LookupTask]:
        return [
            LookupTask(
                LookupData(
                    name=word,
                    prompt=f'Call the `words_lookup` tool with "{word}", then reply with the number it returns.',
                    number=number,
                ),
                self.config.task,
            )
            for word, number in NUMBERS.items()
        ]
