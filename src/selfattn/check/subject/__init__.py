"""The subject of a check: the module built, how it is called, at which sizes, and what probes share.

:mod:`.building` (loading the file, building the module, its sizes), :mod:`.caller` (one call and
its mask convention), :mod:`.calling` (finding the call style, the required mask, the layout and the
sizes it runs at), :mod:`.context` (what every probe reads, and what it returns).
"""
