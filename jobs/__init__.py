"""Job classes: the user's extension point. Every module here is imported at start-up, so a
new job is one class registered with `@JOBS.register("name")` plus one conf/job/*.yaml."""
