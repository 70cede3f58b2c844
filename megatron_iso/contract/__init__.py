"""The Execution Contract: what runs, with which constants, under which claims."""
