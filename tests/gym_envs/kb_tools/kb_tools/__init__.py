from kb_tools.taskset import KBToolsTaskset

__all__ = ["KBToolsTaskset"]
