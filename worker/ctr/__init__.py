"""The built-in CTR job: its DLRM-style model and the job that trains it through the public training API."""
