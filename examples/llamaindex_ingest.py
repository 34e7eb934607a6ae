"""Ingest a document with LlamaIndex's usual recipe, then ask about it with its KV injected.

``VectorStoreIndex.from_documents(documents, storage_context=StorageContext.from_defaults(
vector_store=...))`` and ``index.as_query_engine(llm=...)``, as in LlamaIndex's starter
example. Three things change (marked ★): the vector store (``InferScaleVectorStore``: each
chunk becomes a memory fact of the user, encoded once in the background), the embedding model
(the memory store's own, so no OpenAI key) and the LLM (``InferScaleLLM``). At query time the
retrieved chunks reach the prompt as handles and the engine injects their precomputed KV: the
document is never prefilled again.

Run:
    python examples/llamaindex_ingest.py --demo          # the built-in handbook, three questions
    python examples/llamaindex_ingest.py FILE.txt        # your own text file; ask on the terminal
"""

from __future__ import annotations

import argparse
import uuid
from pathlib import Path
from typing import Any

from llama_index.core import Document, StorageContext, VectorStoreIndex

from inferscale_integrations.llamaindex import (
    InferScaleEmbedding,
    InferScaleLLM,
    InferScaleVectorStore,
)

MODEL = "smollm2"
HANDBOOK = """\
Welcome to the Harbour Lane Bakery. This handbook tells new staff how the bakery works.

Opening hours. The shop opens at 7 in the morning and closes at 6 in the evening, Monday to
Saturday. On Sundays the shop is closed, but the bakers start the Monday dough at 4 in the
afternoon. Bakers begin their shift at 4 in the morning so that the first loaves are ready when
the doors open. Counter staff arrive at half past 6 to fill the shelves and start the coffee
machine.

The ovens. The bakery has two ovens. The big wood-fired oven is called Bertha; it was built in
1962 and it bakes all the sourdough loaves. The small electric oven is called Pip and bakes the
pastries, the croissants and the cakes. Bertha must be lit by 3 in the morning to be hot enough
by 4. Nobody but the head baker may clean Bertha's firebox.

Breads. Our best seller is the rye sourdough, followed by the seeded spelt loaf and the white
farmhouse loaf. Every loaf is weighed before it goes on the shelf: a large loaf must weigh 800
grams and a small one 400 grams. Loaves that are underweight are sold at half price from the
basket by the door.

Holidays. Every member of staff gets 25 days of paid holiday a year, plus the public holidays.
Holidays must be asked for at least four weeks ahead on the calendar in the back office. In
December nobody may take holidays, because it is the busiest month of the year.

Uniforms and safety. Staff wear the green apron and a hair net in the bakery. The first-aid kit
hangs next to the flour store, and the fire blanket is by Pip. Burns are cooled under running
water for twenty minutes.

The team. The head baker is Marta Silva, who has worked here for eighteen years. The shop
manager is Tom Reyes; talk to him about shifts, pay and holidays. Wages are paid on the last
Friday of every month.
"""
QUESTIONS = [
    "What is the name of the wood-fired oven?",
    "How many days of paid holiday do staff get?",
    "Who is the head baker?",
]


def build(engine: Any, user_id: str, documents: list[Document]) -> Any:
    """Ingest ``documents`` for ``user_id``; returns the query engine."""
    vector_store = InferScaleVectorStore(engine=engine, model=MODEL, user_id=user_id)  # ★
    index = VectorStoreIndex.from_documents(
        documents,
        storage_context=StorageContext.from_defaults(vector_store=vector_store),
        embed_model=InferScaleEmbedding(engine=engine, model=MODEL),  # ★ no OpenAI
    )
    llm = InferScaleLLM(engine=engine, model=MODEL, user_id=user_id, max_tokens=32)  # ★
    return index.as_query_engine(llm=llm, similarity_top_k=2)


def main(engine: Any = None, scripted: list[str] | None = None, text: str = HANDBOOK) -> list[str]:
    """Ingest ``text``, then answer the questions (``scripted``, else typed); returns the answers."""
    user_id = f"reader-{uuid.uuid4().hex[:8]}"
    query_engine = build(engine, user_id, [Document(text=text, metadata={"title": "handbook"})])
    answers: list[str] = []
    lines = iter(scripted) if scripted is not None else None
    while True:
        if lines is not None:
            question = next(lines, None)
            if question is None:
                break
        else:
            try:
                question = input("question> ").strip()
            except EOFError:
                break
            if question in ("", "quit", "exit"):
                break
        response = query_engine.query(question)
        answer = str(response).strip()
        answers.append(answer)
        print(f"Q: {question}\nA: {answer}   [{len(response.source_nodes)} chunks, injected as KV]")
    return answers


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", help="a text file to ingest (default: the built-in handbook)")
    parser.add_argument("--demo", action="store_true", help="ask the built-in questions")
    args = parser.parse_args()
    main(scripted=QUESTIONS if args.demo else None, text=Path(args.file).read_text() if args.file else HANDBOOK)
