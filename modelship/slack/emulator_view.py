# ruff: noqa: E501 - an HTML page with its CSS and script, kept as written
"""The Slack emulator's web view: one static page that renders what users would see.

It reads ``/_emulator/messages``, ``/_emulator/ephemeral`` and ``/_emulator/users`` and draws
channels and threads with their Block Kit blocks (header, section text and fields, context,
image, divider, actions). Buttons post to ``/_emulator/click`` as the user picked in the
"click as" list; the emulator turns that into Slack's signed interactivity request.
"""

WEB_VIEW_HTML = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>modelship · Slack emulator</title>
<style>
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;background:#f8f8f8;color:#1d1c1d}
header{background:#3f0e40;color:#fff;padding:10px 16px;display:flex;gap:16px;align-items:center}
header h1{font-size:16px;margin:0;flex:1}
main{padding:12px 16px;max-width:980px}
.channel{margin-bottom:24px}.channel h2{font-size:15px;border-bottom:1px solid #ddd;padding-bottom:4px}
.message{background:#fff;border:1px solid #e2e2e2;border-radius:6px;padding:8px 12px;margin:6px 0}
.reply{margin-left:32px;border-left:3px solid #d0d0d0}
.meta{font-size:11px;color:#777}.edited{font-size:11px;color:#999}
.header{font-size:17px;font-weight:700;margin:4px 0}
.fields{display:grid;grid-template-columns:1fr 1fr;gap:4px 16px;margin:4px 0}
.context{font-size:12px;color:#616061;margin:4px 0}
.actions{display:flex;gap:8px;margin:6px 0}
button.btn{border:1px solid #bbb;background:#fff;border-radius:4px;padding:4px 14px;cursor:pointer;font-weight:600}
button.primary{background:#007a5a;color:#fff;border-color:#007a5a}
button.danger{background:#e01e5a;color:#fff;border-color:#e01e5a}
img.block{max-width:520px;border:1px solid #ddd;margin:4px 0}
.ephemeral{background:#fff8e1;border-color:#f2c744}
code{background:#f1f1f1;padding:0 3px;border-radius:3px}
#status{font-size:13px;color:#fff}
</style></head>
<body>
<header><h1>#releases · modelship Slack emulator</h1>
<label>click as <select id="user"></select></label><span id="status"></span></header>
<main id="channels"><p>loading…</p></main>
<script>
"use strict";
let USERS = {}, GROUPS = {}, last = "";
function esc(t){return String(t??"").replace(/[&<>"']/g,c=>({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;","'":"&#39;"}[c]));}
function mrkdwn(t){
  let h = esc(t);
  h = h.replace(/&lt;@(\w+)&gt;/g,(m,u)=>"<b>@"+esc(USERS[u]||u)+"</b>");
  h = h.replace(/&lt;!subteam\^(\w+)&gt;/g,(m,g)=>"<b>@"+esc((GROUPS[g]||{}).handle||g)+"</b>");
  h = h.replace(/`([^`]+)`/g,"<code>$1</code>").replace(/\*([^*\n]+)\*/g,"<b>$1</b>");
  return h.replace(/:([a-z_+-]+):/g,(m,e)=>({white_check_mark:"✅",x:"❌",no_entry:"⛔",
    hourglass_flowing_sand:"⏳",hourglass:"⌛",warning:"⚠️",rotating_light:"🚨",
    information_source:"ℹ️",fast_forward:"⏩",grey_question:"❔",leftwards_arrow_with_hook:"↩️"}[e]||m))
    .replace(/\n/g,"<br>");
}
function text(o){return o ? (o.type==="mrkdwn" ? mrkdwn(o.text) : esc(o.text)) : "";}
function block(b, m){
  if(b.type==="header") return `<div class="header">${text(b.text)}</div>`;
  if(b.type==="divider") return "<hr>";
  if(b.type==="context") return `<div class="context">${(b.elements||[]).map(text).join(" ")}</div>`;
  if(b.type==="image"){
    const src = b.image_url || (b.slack_file && b.slack_file.id ? "/_emulator/files/"+encodeURIComponent(b.slack_file.id) : "");
    return `<img class="block" alt="${esc(b.alt_text)}" src="${esc(src)}">`;
  }
  if(b.type==="section"){
    let h = b.text ? `<div>${text(b.text)}</div>` : "";
    if(b.fields) h += `<div class="fields">${b.fields.map(f=>`<div>${text(f)}</div>`).join("")}</div>`;
    return h;
  }
  if(b.type==="actions") return `<div class="actions">${(b.elements||[]).map(e=>
    `<button class="btn ${esc(e.style||"")}" data-channel="${esc(m.channel)}" data-ts="${esc(m.ts)}"
      data-action-id="${esc(e.action_id)}" data-value="${esc(e.value)}">${esc(e.text&&e.text.text)}</button>`).join("")}</div>`;
  return `<div class="context">[${esc(b.type)} block]</div>`;
}
function message(m, cls){
  const body = (m.blocks && m.blocks.length) ? m.blocks.map(b=>block(b,m)).join("") : `<div>${mrkdwn(m.text)}</div>`;
  return `<div class="message ${cls}" data-channel="${esc(m.channel)}" data-ts="${esc(m.ts)}">
    <div class="meta">modelship · ${esc(m.ts)} ${m.updated?'<span class="edited">(edited)</span>':""}</div>${body}</div>`;
}
async function refresh(){
  const [msgs, eph] = await Promise.all([fetch("/_emulator/messages").then(r=>r.json()),
                                         fetch("/_emulator/ephemeral").then(r=>r.json())]);
  const me = document.getElementById("user").value;
  const key = JSON.stringify([msgs.messages, eph.messages, me]);
  if(key===last) return; last = key;
  const byChannel = {};
  for(const m of msgs.messages){(byChannel[m.channel] ||= []).push(m);}
  let h = "";
  for(const [ch, list] of Object.entries(byChannel)){
    h += `<section class="channel"><h2>${esc(ch)}</h2>`;
    for(const root of list.filter(m=>!m.thread_ts)){
      h += `<div class="thread" data-thread="${esc(root.ts)}">` + message(root,"root");
      for(const r of list.filter(m=>m.thread_ts===root.ts)) h += message(r,"reply");
      for(const e of eph.messages.filter(e=>e.user===me && (e.thread_ts===root.ts || list.some(r=>r.ts===e.thread_ts && r.thread_ts===root.ts))))
        h += `<div class="message reply ephemeral"><div class="meta">only visible to you</div>${mrkdwn(e.text)}</div>`;
      h += "</div>";
    }
    h += "</section>";
  }
  document.getElementById("channels").innerHTML = h || "<p>no messages yet</p>";
}
document.addEventListener("click", async ev=>{
  const b = ev.target.closest("button.btn"); if(!b) return;
  const status = document.getElementById("status");
  status.textContent = "sending…";
  const r = await fetch("/_emulator/click",{method:"POST",headers:{"Content-Type":"application/json"},
    body:JSON.stringify({channel:b.dataset.channel, ts:b.dataset.ts, action_id:b.dataset.actionId,
                         value:b.dataset.value, user:document.getElementById("user").value})});
  const j = await r.json();
  status.textContent = j.ok ? "click accepted" : `refused: ${j.status||""} ${(j.answer&&j.answer.error)||j.error||""}`;
  status.dataset.result = j.ok ? "accepted" : "refused";
  last = ""; refresh();
});
async function start(){
  const u = await fetch("/_emulator/users").then(r=>r.json());
  USERS = u.users; GROUPS = u.usergroups || {};
  const sel = document.getElementById("user");
  sel.innerHTML = Object.entries(USERS).map(([id,n])=>`<option value="${esc(id)}">${esc(n)} (${esc(id)})</option>`).join("");
  sel.addEventListener("change",()=>{last="";refresh();});
  await refresh(); setInterval(refresh, 1000);
}
start();
</script></body></html>
"""
