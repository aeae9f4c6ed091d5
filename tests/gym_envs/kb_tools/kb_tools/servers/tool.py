"""A verifiers toolset as `vf-init --add-tool` scaffolds one: a small fixed fact base to search."""

import verifiers.v1 as vf

FACTS = {
    "tavo": "Tavo Mirel works at Acme Labs.",
    "acme": "Acme Labs is based in Orvin.",
    "orvin": "Orvin is a city in Lendia.",
    "mira": "Mira Kost works at Bolt Group.",
    "bolt": "Bolt Group is based in Sarn.",
}


class KBToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # tools advertised bare: `search`

    @vf.tool
    def search(self, query: str) -> str:
        """Search the fact base; returns the facts whose subject the query names."""
        words = {w.strip(".,?!").lower() for w in query.split()}
        hits = [fact for key, fact in FACTS.items() if key in words]
        return "\n".join(hits) if hits else "no results"


if __name__ == "__main__":
    KBToolset.run()
