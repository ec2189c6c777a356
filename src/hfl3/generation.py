"""Greedy answers of a chat model to single-turn prompts, through its chat template (the SFT recipe's
`samples.json`)."""

import torch


@torch.no_grad()
def answer_prompts(
    model, tokenizer, prompts: list[str], max_new_tokens: int, end_of_turn: str | None = None
) -> list[dict]:
    """Greedy answers of `model` to single-turn user `prompts`, through the tokenizer's chat template; generation
    stops at `tokenizer.eos_token`, at the template's `end_of_turn` text when it is one token, or after
    `max_new_tokens`.

    Returns:
        `[{"prompt": ..., "answer": ...}, ...]` (answers decoded without special tokens).
    """
    stop_ids = {tokenizer.eos_token_id}
    if end_of_turn is not None:
        end_ids = tokenizer(end_of_turn, add_special_tokens=False)["input_ids"]
        stop_ids.update(end_ids if len(end_ids) == 1 else [])
    model.eval()
    answers = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = tokenizer(text, add_special_tokens=False, return_tensors="pt").to(model.device)
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(i for i in stop_ids if i is not None),
            pad_token_id=tokenizer.pad_token_id,
        )
        answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        answers.append({"prompt": prompt, "answer": answer.strip()})
    return answers
