"""The tool of word_lookup: a fixed table of words and numbers, served over MCP by verifiers."""

import verifiers.v1 as vf

NUMBERS = {
    word: str(100 + 7 * i)
    for i, word in enumerate(["apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "amber", "cedar", "flint"])
}


class LookupToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "words"

    @vf.tool
    def lookup(self, word: str) -> str:
        """The secret number of a word."""
        return NUMBERS.get(word.strip().lower(), "no such word")


if __name__ == "__main__":
    LookupToolset.run()
