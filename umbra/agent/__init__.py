"""The reference agent: pairs a node, reports its devices, claims and runs jobs.

``client`` speaks the agent protocol over HTTP, ``devices`` discovers what the
machine has, ``handlers`` maps job kinds to code, ``runner`` is the loop that
ties them together, and ``cli`` is ``umbra agent``.
"""
