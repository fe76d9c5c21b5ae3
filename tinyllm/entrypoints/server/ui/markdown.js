// Markdown-ish rendering of a message into DOM nodes: ``` code blocks, # headings, `code` and
// **bold**; paragraphs keep their line breaks (CSS). Text only ever goes into text nodes, so
// HTML in a message shows as text and nothing in it runs.

function element(tag, text) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  return node;
}

// `text` into `parent`: inline code and bold as elements, the rest as text nodes.
function inline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(/`([^`\n]+)`|\*\*([^*\n]+)\*\*/g)) {
    parent.append(text.slice(last, m.index));
    parent.append(m[1] !== undefined ? element("code", m[1]) : element("strong", m[2]));
    last = m.index + m[0].length;
  }
  parent.append(text.slice(last));
}

export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let paragraph = [];
  const flush = () => {
    if (paragraph.length === 0) return;
    const p = element("p");
    inline(p, paragraph.join("\n"));
    out.append(p);
    paragraph = [];
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+-]*)/);
    const heading = line.match(/^(#{1,6})\s+(.*)/);
    if (fence) {
      flush();
      const code = [];
      // Up to the closing fence, or the end while the block is still streaming in.
      while (i + 1 < lines.length && !/^\s*```\s*$/.test(lines[i + 1])) code.push(lines[++i]);
      i++;
      const block = element("code", code.join("\n"));
      if (fence[1]) block.dataset.lang = fence[1];
      const pre = element("pre");
      pre.append(block);
      out.append(pre);
    } else if (heading) {
      flush();
      const h = element(`h${Math.min(heading[1].length + 2, 6)}`);
      inline(h, heading[2]);
      out.append(h);
    } else if (line.trim() === "") {
      flush();
    } else {
      paragraph.push(line);
    }
  }
  flush();
  return out;
}
