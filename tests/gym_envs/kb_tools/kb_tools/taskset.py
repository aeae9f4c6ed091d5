"""A verifiers (v1) taskset with a toolset and a rubric, written as a verifiers user writes one (the layout
of `vf-init kb-tools --add-tool`); the treeopsd tests train on it through `env.name = gym` unchanged."""

import verifiers.v1 as vf

from kb_tools.servers.tool import KBToolset

QUESTIONS = [
    ("Where does Tavo Mirel work?", "Acme Labs"),
    ("In which city is Acme Labs based?", "Orvin"),
    ("Where does Mira Kost work?", "Bolt Group"),
    ("In which city is Bolt Group based?", "Sarn"),
]


class KBToolsData(vf.TaskData):
    answer: str


class KBToolsTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class KBToolsTask(vf.Task[KBToolsData, vf.State, KBToolsTaskConfig]):
    @classmethod
    def toolsets(cls, config: KBToolsTaskConfig) -> list[vf.Toolset]:
        return [KBToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """The final reply names the answer."""
        return float(self.data.answer.lower() in trace.last_reply.lower())

    @vf.reward(weight=0.25)
    async def searched(self, trace: vf.Trace) -> float:
        """The agent looked something up before replying."""
        return float(len(trace.tool_messages) > 0)


class KBToolsConfig(vf.TasksetConfig):
    num_tasks: int = 4
    task: KBToolsTaskConfig = KBToolsTaskConfig()


class KBToolsTaskset(vf.Taskset[KBToolsTask, KBToolsConfig]):
    def load(self) -> list[KBToolsTask]:
        system = "Answer the question. Search the fact base first; reply with a short answer."
        return [
            KBToolsTask(KBToolsData(id=f"kb-{i}", prompt=q, system_prompt=system, answer=a), self.config.task)
            for i, (q, a) in enumerate(QUESTIONS[: self.config.num_tasks])
        ]
