// The copy button of a doctest block copies its code only: the code of ">>> " and "... " lines
// without the prompts, and none of the expected output (or traceback) lines. A statement that
// follows an indented block gets a blank line before it, so the text also pastes into a REPL.
// Material for MkDocs copies an element's `data-copy` attribute when it has one, its text
// otherwise; this script sets the attribute on every code block that starts with ">>>".
"use strict";

function promptFree(text) {
  const lines = text.replace(/\n+$/, "").split("\n");
  if (!/^>>>( |$)/.test(lines[0])) {
    return null; // not a doctest: copied as it is
  }
  const code = [];
  let inStatement = false;
  let indented = false;
  for (const line of lines) {
    if (/^>>>( |$)/.test(line)) {
      if (indented) {
        code.push("");
      }
      code.push(line.slice(4));
      inStatement = true;
      indented = false;
    } else if (inStatement && /^\.\.\.( |$)/.test(line)) {
      code.push(line.slice(4));
      indented = true;
    } else {
      inStatement = false; // expected output: "..." here is an ellipsis, not a continuation
    }
  }
  return code.join("\n");
}

function markDoctests() {
  for (const code of document.querySelectorAll(".highlight pre > code")) {
    const text = promptFree(code.textContent);
    if (text !== null) {
      code.setAttribute("data-copy", text);
    }
  }
}

if (typeof document$ !== "undefined") {
  document$.subscribe(markDoctests); // Material's page-load stream (instant navigation too)
} else if (typeof document !== "undefined") {
  document.addEventListener("DOMContentLoaded", markDoctests);
}

if (typeof module !== "undefined") {
  module.exports = { promptFree };
}
