"""The coding agents' APIs, as translations onto chat completions (torch-free, in the edge).

Codex CLI speaks OpenAI's Responses API, Claude Code Anthropic's Messages API. Each request is
translated into the chat completions body the server already serves (one resolution, one tool
grammar and parser per family, one quality report, one set of policies), run by the product's
`ChatBackend` (`serve`'s engine or the gateway's upstream), and its chat answer (whole or
streamed) translated back. `sampling` and `quality` ride along as extra top-level fields.

| module              | one concept                                                        |
|---------------------|--------------------------------------------------------------------|
| backend.py          | what a product provides: run a chat body, count a prompt's tokens  |
| content.py          | what both APIs share: text of content parts, tools left out        |
| responses_input.py  | a Responses body -> a chat body (input items, tools, formats)      |
| responses_output.py | a chat answer -> a Response object                                 |
| responses_events.py | a chat stream -> the Responses API's events                        |
| response_store.py   | stored responses (bounded; `previous_response_id`, GET, DELETE)     |
| messages_input.py   | a Messages body -> a chat body (blocks, tools, system)             |
| messages_output.py  | a chat answer -> a Message, or its stream of events                |
| routes.py           | the routes of both APIs over a ChatBackend                         |
"""
